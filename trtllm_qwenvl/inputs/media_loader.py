"""Media references from chat messages -> decoded images and videos, under the configured media rules.

Sources are data URIs, `file://` URLs or bare paths under `allowed_local_media_path`, and http(s) URLs when
remote media is allowed. Every refusal is a ValueError naming the rule, which the server turns into a 400.
"""
import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import httpx

from .media import decode_image, decode_video
from .processor import Video

DEFAULT_VIDEO_IO = {"fps": 2.0, "max_frames": 256}


@dataclass
class MediaRules:
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    fetch_timeout: float = 10.0
    max_bytes: int = 64 << 20
    max_pixels: int | None = None
    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    io_kwargs: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args) -> "MediaRules":
        return cls(args.allowed_local_media_path, args.allow_remote_media, args.media_fetch_timeout,
                   args.max_media_bytes, args.max_media_pixels, dict(args.limit_mm_per_prompt),
                   dict(args.media_io_kwargs))


class MediaLoader:
    def __init__(self, rules: MediaRules):
        self.rules = rules
        self.root = Path(rules.allowed_local_media_path).resolve() if rules.allowed_local_media_path else None

    def check_counts(self, counts: dict[str, int]) -> None:
        for modality, n in counts.items():
            limit = self.rules.limit_per_prompt.get(modality)
            if limit is not None and n > limit:
                raise ValueError(f"the prompt has {n} {modality}(s), more than limit_mm_per_prompt[{modality!r}]"
                                 f"={limit}")

    def load(self, modality: str, source):
        if not isinstance(source, str):
            raise ValueError(f"a {modality} source must be a URL string, got {type(source).__name__}")
        data = self.read(source)
        if modality == "image":
            return decode_image(data, self.rules.max_pixels)
        return self.video(data)

    def video(self, data: bytes) -> Video:
        io_kwargs = {**DEFAULT_VIDEO_IO, **self.rules.io_kwargs.get("video", {})}
        if io_kwargs.get("num_frames"):
            io_kwargs.pop("fps", None)
        unknown = set(io_kwargs) - {"num_frames", "fps", "max_frames"}
        if unknown:
            raise ValueError(f"unknown media_io_kwargs for video: {sorted(unknown)}")
        return decode_video(data, max_pixels=self.rules.max_pixels, **io_kwargs)

    def read(self, url: str) -> bytes:
        if url.startswith("data:"):
            return self.read_data_uri(url)
        if url.startswith(("http://", "https://")):
            return self.fetch(url)
        return self.read_file(file_url_path(url) if url.startswith("file://") else url)

    def read_data_uri(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ValueError("a data URI must be base64: data:<mime>;base64,<payload>")
        too_large = ValueError(f"the data URI is larger than max_media_bytes={self.rules.max_bytes}")
        if len(payload) > (self.rules.max_bytes + 2) // 3 * 4:  # refuse before decoding what cannot fit
            raise too_large
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"malformed base64 in data URI: {e}") from e
        if len(data) > self.rules.max_bytes:
            raise too_large
        return data

    def read_file(self, name: str) -> bytes:
        if self.root is None:
            raise ValueError("local media files are not allowed; start the server with --allowed_local_media_path")
        path = Path(name).resolve()  # resolves `..` and symlinks before the containment check
        if not path.is_relative_to(self.root):
            raise ValueError(f"file {name} is outside the allowed local media path {self.root}")
        if not path.is_file():
            raise ValueError(f"media file not found: {name}")
        if path.stat().st_size > self.rules.max_bytes:
            raise ValueError(f"file {name} is larger than max_media_bytes={self.rules.max_bytes}")
        return path.read_bytes()

    def fetch(self, url: str) -> bytes:
        if not self.rules.allow_remote_media:
            raise ValueError("remote media URLs are not allowed; start the server with --allow_remote_media")
        chunks, size = [], 0
        try:
            with httpx.stream("GET", url, timeout=self.rules.fetch_timeout, follow_redirects=True) as response:
                response.raise_for_status()
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > self.rules.max_bytes:
                        raise ValueError(f"{url} is larger than max_media_bytes={self.rules.max_bytes}")
                    chunks.append(chunk)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise ValueError(f"could not fetch {url}: {e}") from e
        return b"".join(chunks)


def file_url_path(url: str) -> str:
    """The local path of a file:// URL, percent-decoded, as `Path.as_uri()` writes it."""
    parts = urlparse(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URL {url} names a remote host")
    return url2pathname(parts.path)
