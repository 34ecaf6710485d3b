"""MediaLoader and build_chat_prompt: sources, media rules and video sampling, checked against PIL / PyAV directly."""
import base64
import functools
import http.server
import io
import socket
import struct
import threading
import time
import zlib

import av
import numpy as np
import pytest
import transformers
from PIL import Image

from trtllm_qwenvl.inputs.chat import build_chat_prompt
from trtllm_qwenvl.inputs.media_loader import MediaLoader, MediaRules
from trtllm_qwenvl.models import tiny

from conftest import MEDIA

PNG = (MEDIA / "sample.png").read_bytes()
MP4 = (MEDIA / "sample.mp4").read_bytes()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def pil_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def pyav_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


def make_video(fmt: str, num_frames: int = 20, rate: int = 10, size: int = 32) -> bytes:
    """Frames of distinct grey levels, so a wrong frame index shows up as wrong pixels."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = np.full((size, size, 3), 10 * i, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height but holds almost no pixel data: decoding it would be the bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def loader(**rules) -> MediaLoader:
    return MediaLoader(MediaRules(**rules))


@pytest.fixture(scope="module")
def video20():
    return make_video("mp4")


# --- data URIs ---

def test_data_uri_png_decodes_like_pil():
    image = loader().load("image", data_uri(PNG))
    assert image.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(image), pil_pixels(PNG))


def test_data_uri_without_base64_is_refused():
    with pytest.raises(ValueError, match="must be base64"):
        loader().load("image", "data:image/png," + base64.b64encode(PNG).decode())


def test_data_uri_with_bad_base64_is_refused():
    with pytest.raises(ValueError, match="malformed base64"):
        loader().load("image", "data:image/png;base64,@@@not-base64@@@")


def test_data_uri_over_max_bytes_is_refused():
    with pytest.raises(ValueError, match="larger than max_media_bytes=1000"):
        loader(max_bytes=1000).load("image", data_uri(PNG))


def test_data_uri_exactly_max_bytes_is_accepted():
    # sample.png's base64 ends in padding; the limit is on the decoded bytes, as for files and URLs.
    image = loader(max_bytes=len(PNG)).load("image", data_uri(PNG))
    np.testing.assert_array_equal(np.asarray(image), pil_pixels(PNG))


def test_data_uri_of_non_image_bytes_is_refused():
    with pytest.raises(ValueError, match="not a decodable image"):
        loader().load("image", data_uri(b"just some text, not a picture"))


def test_non_string_source_is_refused():
    with pytest.raises(ValueError, match="URL string"):
        loader().load("image", {"url": data_uri(PNG)})


# --- local files ---

@pytest.fixture
def dirs(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "in.png").write_bytes(PNG)
    (outside / "out.png").write_bytes(PNG)
    return allowed, outside


def test_local_file_refused_without_allowed_dir(dirs):
    allowed, _ = dirs
    with pytest.raises(ValueError, match="--allowed_local_media_path"):
        loader().load("image", str(allowed / "in.png"))


@pytest.mark.parametrize("form", ["bare", "file_url"])
def test_local_file_inside_allowed_dir(dirs, form):
    allowed, _ = dirs
    path = str(allowed / "in.png")
    source = "file://" + path if form == "file_url" else path
    image = loader(allowed_local_media_path=str(allowed)).load("image", source)
    np.testing.assert_array_equal(np.asarray(image), pil_pixels(PNG))


def test_file_uri_made_by_pathlib_is_accepted(dirs):
    # Path.as_uri() percent-encodes, as any client building a file:// URL does.
    allowed, _ = dirs
    path = allowed / "with space.png"
    path.write_bytes(PNG)
    image = loader(allowed_local_media_path=str(allowed)).load("image", path.as_uri())
    np.testing.assert_array_equal(np.asarray(image), pil_pixels(PNG))


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_dotdot_escape_is_refused(dirs, prefix):
    allowed, _ = dirs
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        loader(allowed_local_media_path=str(allowed)).load("image", f"{prefix}{allowed}/../outside/out.png")


def test_symlink_pointing_outside_is_refused(dirs):
    allowed, outside = dirs
    (allowed / "link.png").symlink_to(outside / "out.png")
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        loader(allowed_local_media_path=str(allowed)).load("image", str(allowed / "link.png"))


def test_symlinked_dir_pointing_outside_is_refused(dirs):
    allowed, outside = dirs
    (allowed / "sub").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the allowed local media path"):
        loader(allowed_local_media_path=str(allowed)).load("image", f"file://{allowed}/sub/out.png")


def test_missing_file_is_refused(dirs):
    allowed, _ = dirs
    with pytest.raises(ValueError, match="not found"):
        loader(allowed_local_media_path=str(allowed)).load("image", str(allowed / "nope.png"))


def test_file_over_max_bytes_is_refused(dirs):
    allowed, _ = dirs
    rules = dict(allowed_local_media_path=str(allowed))
    with pytest.raises(ValueError, match=f"larger than max_media_bytes={len(PNG) - 1}"):
        loader(max_bytes=len(PNG) - 1, **rules).load("image", str(allowed / "in.png"))
    loader(max_bytes=len(PNG), **rules).load("image", str(allowed / "in.png"))


# --- remote URLs ---

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    (root / "sample.png").write_bytes(PNG)
    (root / "big.bin").write_bytes(b"\0" * 300_000)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_url_refused_when_not_allowed():
    with pytest.raises(ValueError, match="--allow_remote_media"):
        loader().load("image", "http://127.0.0.1:9/sample.png")


def test_remote_png_is_fetched(http_root):
    image = loader(allow_remote_media=True, fetch_timeout=5).load("image", f"{http_root}/sample.png")
    np.testing.assert_array_equal(np.asarray(image), pil_pixels(PNG))


def test_remote_file_over_max_bytes_is_refused(http_root):
    with pytest.raises(ValueError, match="larger than max_media_bytes=100000"):
        loader(allow_remote_media=True, fetch_timeout=5, max_bytes=100_000).load("image", f"{http_root}/big.bin")


def test_remote_404_is_refused(http_root):
    with pytest.raises(ValueError, match="could not fetch"):
        loader(allow_remote_media=True, fetch_timeout=5).load("image", f"{http_root}/missing.png")


def test_unreachable_url_is_refused():
    with pytest.raises(ValueError, match="could not fetch"):
        loader(allow_remote_media=True, fetch_timeout=1).load("image", f"http://127.0.0.1:{free_port()}/x.png")


def test_malformed_remote_url_is_refused():
    # Every refusal should be a ValueError (a 400), including URLs httpx cannot parse.
    with pytest.raises(ValueError):
        loader(allow_remote_media=True, fetch_timeout=1).load("image", "http://[::1/x.png")


# --- pixel caps ---

def test_image_pixel_cap():
    width, height = Image.open(io.BytesIO(PNG)).size
    loader(max_pixels=width * height).load("image", data_uri(PNG))
    with pytest.raises(ValueError, match=f"{width}x{height} = {width * height} pixels exceeds max_media_pixels"):
        loader(max_pixels=width * height - 1).load("image", data_uri(PNG))


def test_huge_dimension_png_refused_from_header():
    bomb = png_header_only(8000, 8000)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="8000x8000 = 64000000 pixels exceeds max_media_pixels=1000000"):
        loader(max_pixels=1_000_000).load("image", data_uri(bomb))
    assert time.perf_counter() - start < 0.5  # decoding 8000x8000 RGB would allocate 192 MB


def test_video_pixel_cap():
    loader(max_pixels=128 * 128).load("video", data_uri(MP4, "video/mp4"))
    with pytest.raises(ValueError, match="128x128"):
        loader(max_pixels=128 * 128 - 1).load("video", data_uri(MP4, "video/mp4"))


# --- video sampling ---

def video_loader(**video_io) -> MediaLoader:
    return loader(io_kwargs={"video": video_io})


def test_video_default_sampling_is_2_fps():
    video = loader().load("video", data_uri(MP4, "video/mp4"))  # 8 frames at 4 fps
    np.testing.assert_array_equal(video.frames, pyav_frames(MP4)[[0, 2, 4, 6]])
    assert video.fps == pytest.approx(2.0)


@pytest.mark.parametrize("fmt", ["mp4", "matroska"])  # matroska does not state the frame count up front
def test_video_num_frames_evenly_spaced(fmt):
    data = make_video(fmt)
    video = video_loader(num_frames=5).load("video", data_uri(data, "video/mp4"))
    expected = np.linspace(0, 19, 5).round().astype(int)
    np.testing.assert_array_equal(video.frames, pyav_frames(data)[expected])
    assert video.fps == pytest.approx(10 * 4 / (expected[-1] - expected[0]))


def test_video_num_frames_overrides_default_fps(video20):
    video = video_loader(num_frames=20).load("video", data_uri(video20, "video/mp4"))
    np.testing.assert_array_equal(video.frames, pyav_frames(video20))


def test_video_num_frames_more_than_available(video20):
    video = video_loader(num_frames=50).load("video", data_uri(video20, "video/mp4"))
    assert len(video.frames) == 20


def test_video_fps_sampling(video20):
    video = video_loader(fps=2.5).load("video", data_uri(video20, "video/mp4"))  # native 10 fps: every 4th frame
    np.testing.assert_array_equal(video.frames, pyav_frames(video20)[[0, 4, 8, 12, 16]])
    assert video.fps == pytest.approx(2.5)


def test_video_max_frames_cap(video20):
    video = video_loader(fps=10, max_frames=4).load("video", data_uri(video20, "video/mp4"))
    expected = np.linspace(0, 19, 4).round().astype(int)
    np.testing.assert_array_equal(video.frames, pyav_frames(video20)[expected])


def test_video_unknown_io_kwarg_is_refused(video20):
    with pytest.raises(ValueError, match="frame_rate"):
        video_loader(frame_rate=3).load("video", data_uri(video20, "video/mp4"))


def test_garbage_video_is_refused():
    with pytest.raises(ValueError, match="not a decodable video"):
        loader().load("video", data_uri(b"\x00garbage" * 100, "video/mp4"))


# --- chat prompts: limits and uuids ---

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    ckpt = tiny.make_tiny("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"), seed=0)
    return transformers.AutoTokenizer.from_pretrained(ckpt)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def test_image_limit_checked_before_loading(tokenizer, dirs):
    allowed, outside = dirs
    rules = dict(allowed_local_media_path=str(allowed), limit_per_prompt={"image": 1})
    unloadable = image_part(f"file://{outside}/out.png")
    # One such image is within the limit and fails on loading...
    with pytest.raises(ValueError, match="outside the allowed"):
        build_chat_prompt(tokenizer, user(unloadable), loader(**rules))
    # ...two fail on the limit, so nothing was read.
    with pytest.raises(ValueError, match=r"2 image\(s\), more than limit_mm_per_prompt\['image'\]=1"):
        build_chat_prompt(tokenizer, user(unloadable, unloadable), loader(**rules))


def test_video_limit(tokenizer):
    video = {"type": "video_url", "video_url": {"url": "file:///nonexistent.mp4"}}
    with pytest.raises(ValueError, match=r"limit_mm_per_prompt\['video'\]=0"):
        build_chat_prompt(tokenizer, user(video), loader(limit_per_prompt={"video": 0}))


def test_chat_prompt_placeholders_media_and_uuids(tokenizer):
    other = np.asarray(Image.open(io.BytesIO(PNG)).rotate(90, expand=True))
    other_png = io.BytesIO()
    Image.fromarray(other).save(other_png, format="PNG")
    messages = user(
        image_part(data_uri(PNG), uuid="img-a"),
        {"type": "video_url", "video_url": {"url": data_uri(MP4, "video/mp4")}, "uuid": "vid-a"},
        image_part(data_uri(other_png.getvalue())),
        {"type": "text", "text": "Compare them."},
    )
    prompt = build_chat_prompt(tokenizer, messages, loader(limit_per_prompt={"image": 2, "video": 1}))
    assert prompt["prompt"].count("<|image_pad|>") == 2
    assert prompt["prompt"].count("<|video_pad|>") == 1
    assert "Compare them." in prompt["prompt"]
    images = prompt["multi_modal_data"]["image"]
    np.testing.assert_array_equal(np.asarray(images[0]), pil_pixels(PNG))
    np.testing.assert_array_equal(np.asarray(images[1]), other)
    assert len(prompt["multi_modal_data"]["video"]) == 1
    assert prompt["multi_modal_uuids"] == {"image": ["img-a", None], "video": ["vid-a"]}


def test_chat_prompt_without_uuids_has_no_uuid_key(tokenizer):
    prompt = build_chat_prompt(tokenizer, user(image_part(data_uri(PNG)), {"type": "text", "text": "hi"}), loader())
    assert prompt["prompt"].count("<|image_pad|>") == 1
    assert "multi_modal_uuids" not in prompt


def test_chat_prompt_text_only(tokenizer):
    prompt = build_chat_prompt(tokenizer, [{"role": "user", "content": "hello"}], loader())
    assert "hello" in prompt["prompt"] and "<|image_pad|>" not in prompt["prompt"]
    assert "multi_modal_data" not in prompt
