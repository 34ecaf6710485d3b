"""Decoding: PIL images and sampled video frames from bytes, with pixel caps checked before the full decode."""
import io
from pathlib import Path

import numpy as np
from PIL import Image

from .processor import Video


def check_pixels(width: int, height: int, max_pixels: int | None, what: str) -> None:
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(f"{what} of {width}x{height} = {width * height} pixels exceeds max_media_pixels={max_pixels}")


def decode_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only, so the size is known before decoding
        check_pixels(*image.size, max_pixels, "an image")
        return image.convert("RGB")
    except (OSError, Image.UnidentifiedImageError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a decodable image: {e}") from e


def load_image(source) -> Image.Image:
    """A PIL image or a local path, for code that names its own files; URLs go through MediaLoader."""
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    return decode_image(Path(source).read_bytes())


def frame_indices(total: int, native_fps: float, num_frames: int | None, fps: float | None,
                  max_frames: int | None) -> np.ndarray:
    """Which of `total` frames to keep: `num_frames` evenly spaced, or one per 1/`fps` s, capped at `max_frames`."""
    if num_frames:
        keep = np.linspace(0, total - 1, min(num_frames, total)).round().astype(int)
    elif fps:
        keep = np.arange(0, total, max(native_fps / fps, 1.0)).astype(int)
    else:
        keep = np.arange(total)
    if max_frames and len(keep) > max_frames:
        keep = keep[np.linspace(0, len(keep) - 1, max_frames).round().astype(int)]
    return keep


def decode_video(data: bytes, num_frames: int | None = None, fps: float | None = None,
                 max_frames: int | None = None, max_pixels: int | None = None) -> Video:
    """Decode with PyAV, keeping only the sampled frames in memory when the container states its frame count."""
    import av
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            check_pixels(stream.codec_context.width, stream.codec_context.height, max_pixels, "a video frame")
            native_fps = float(stream.average_rate or 2.0)
            total = stream.frames
            keep = set(frame_indices(total, native_fps, num_frames, fps, max_frames).tolist()) if total else None
            frames, index = [], []
            for i, frame in enumerate(container.decode(stream)):
                if keep is None or i in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    index.append(i)
    except (av.error.FFmpegError, IndexError, ValueError) as e:
        raise ValueError(f"not a decodable video: {e}") from e
    if not frames:
        raise ValueError("not a decodable video: it has no frames")
    index = np.asarray(index)
    if keep is None:  # frame count unknown up front: sample what was decoded
        chosen = frame_indices(len(frames), native_fps, num_frames, fps, max_frames)
        frames, index = [frames[i] for i in chosen], index[chosen]
    span = index[-1] - index[0]
    sampled_fps = native_fps * (len(index) - 1) / span if span > 0 else native_fps
    return Video(np.stack(frames), sampled_fps)


def load_video(source, **io_kwargs) -> Video:
    """Frames, a Video, or a local path, for code that names its own files; URLs go through MediaLoader."""
    if isinstance(source, (np.ndarray, dict, Video)):
        return Video.of(source)
    return decode_video(Path(source).read_bytes(), **io_kwargs)
