"""Media loading: PIL images and decoded video frames from objects, data URIs or local paths."""
import base64
import io
from pathlib import Path

import numpy as np
from PIL import Image

from .processor import Video


def read_bytes(source: str) -> bytes:
    if source.startswith("data:"):
        try:
            return base64.b64decode(source.split(",", 1)[1], validate=True)
        except (IndexError, ValueError) as e:
            raise ValueError(f"malformed base64 data URI: {e}") from e
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    if not path.is_file():
        raise ValueError(f"media file not found: {path}")
    return path.read_bytes()


def load_image(source) -> Image.Image:
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        return Image.open(io.BytesIO(read_bytes(source))).convert("RGB")
    except (OSError, Image.UnidentifiedImageError) as e:
        raise ValueError(f"not a decodable image: {e}") from e


def decode_video(data: bytes, num_frames: int | None = None, fps: float | None = None) -> Video:
    """Decode with PyAV; keep `num_frames` evenly spaced frames, or sample at `fps`, else every frame."""
    import av
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            native_fps = float(stream.average_rate or 2.0)
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    except (av.error.FFmpegError, IndexError, ValueError) as e:
        raise ValueError(f"not a decodable video: {e}") from e
    if num_frames:
        keep = np.linspace(0, len(frames) - 1, min(num_frames, len(frames))).round().astype(int)
    elif fps:
        keep = np.arange(0, len(frames), max(native_fps / fps, 1.0)).astype(int)
    else:
        return Video(frames, native_fps)
    sampled_fps = native_fps * (len(keep) - 1) / max(keep[-1] - keep[0], 1) if len(keep) > 1 else native_fps
    return Video(frames[keep], sampled_fps)


def load_video(source, **io_kwargs) -> Video:
    if isinstance(source, (np.ndarray, dict, Video)):
        return Video.of(source)
    return decode_video(read_bytes(source), **io_kwargs)
