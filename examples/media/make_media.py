"""Regenerate the bundled sample media: sample.png and sample.mp4 next to this script.

Both are synthetic (gradients and shapes) so they are small, license-free and reproducible.
"""

import pathlib

import av
from PIL import Image, ImageDraw

HERE = pathlib.Path(__file__).resolve().parent

IMAGE_SIZE = (224, 160)
VIDEO_SIZE = 128
VIDEO_FRAMES = 8
VIDEO_FPS = 4


def draw_image() -> Image.Image:
    width, height = IMAGE_SIZE
    image = Image.new("RGB", IMAGE_SIZE)
    # A horizontal red ramp against a vertical blue ramp gives every pixel a distinct colour.
    image.putdata([(255 * x // width, 96, 255 * y // height) for y in range(height) for x in range(width)])
    draw = ImageDraw.Draw(image)
    draw.ellipse((20, 20, 100, 100), fill=(250, 210, 40), outline=(0, 0, 0), width=3)
    draw.rectangle((120, 40, 200, 120), fill=(40, 200, 90), outline=(255, 255, 255), width=3)
    draw.polygon([(60, 150), (110, 105), (160, 150)], fill=(230, 60, 160))
    draw.line((0, 135, 224, 135), fill=(255, 255, 255), width=2)
    return image


def draw_frame(index: int) -> Image.Image:
    frame = Image.new("RGB", (VIDEO_SIZE, VIDEO_SIZE), (30, 30 + 20 * index, 90))
    draw = ImageDraw.Draw(frame)
    # The square crosses the frame diagonally so consecutive frames differ in position, not just colour.
    step = (VIDEO_SIZE - 40) // (VIDEO_FRAMES - 1)
    x = y = 4 + step * index
    draw.rectangle((x, y, x + 32, y + 32), fill=(240, 200, 30))
    draw.ellipse((88 - 8 * index, 16, 120 - 8 * index, 48), fill=(220, 50, 50))
    return frame


def write_video(path: pathlib.Path) -> None:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=VIDEO_FPS)
        stream.width = stream.height = VIDEO_SIZE
        stream.pix_fmt = "yuv420p"
        for index in range(VIDEO_FRAMES):
            frame = av.VideoFrame.from_image(draw_frame(index))
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def main() -> None:
    draw_image().save(HERE / "sample.png", optimize=True)
    write_video(HERE / "sample.mp4")


if __name__ == "__main__":
    main()
