"""Prompt -> token ids, media items and mRoPE positions.

Text-only prompts take the tokenizer alone. Prompts with images alone take the checkpoint's HF image processor and
the tokenizer, then expand each placeholder to its image's token count as the HF processor's text step does; prompts
with video run the whole HF processor, whose video text (per-frame timestamps) is its own. All of it on the host,
except the pixels' rescale and normalise, which the encoder applies on the device (`pixels.PixelNorm`), and the
patchify of images the processor would keep at their size, which the encoder runs too (`pixels.DevicePatchify`).
(The whole image processor on the GPU saved 0.2 ms per 512px image on an H100, perf/results/preprocess_*, but its
pixels then sat in device memory outside the KV budget until encoded: a benchmark with 256 requests queued ran out
of memory.)

Media go to `on_media` (the engine's early encode) as soon as their pixels and content hashes exist, before the
prompt's mRoPE positions are computed, so the vision tower runs while the rest of preprocessing does. An images-only
prompt's text is tokenized on a thread of `tokenizing` meanwhile: the Rust tokenizer releases the GIL, so it runs
beside the pixels and their encode instead of after them.
"""
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from ..engine.sequence import MMItem, ProcessedPrompt
from .hashing import hash_media
from .mrope import MRopeSpec, get_rope_index, text_positions
from .pixels import RAW, DevicePatchify, PixelNorm

PLACEHOLDERS = {"image": "<|image_pad|>", "video": "<|video_pad|>"}
NO_POSITIONS = np.empty(0, dtype=np.int64)


@dataclass
class Video:
    """Decoded frames (T, H, W, 3) uint8 at `fps`; frames are used as given, never re-sampled."""
    frames: np.ndarray
    fps: float = 2.0

    @classmethod
    def of(cls, video) -> "Video":
        if isinstance(video, Video):
            return video
        if isinstance(video, dict):
            return cls(np.asarray(video["frames"]), float(video.get("fps", 2.0)))
        return cls(np.asarray(video))


def as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


class InputProcessor:
    def __init__(self, model_dir: str, hf_config, tokenizer=None, pin_pixels: bool = False, workers: int = 1):
        """`pin_pixels` (GPU engines): keep pixels in pinned memory so their H2D copy does not block the engine's
        host thread. `workers`: threads tokenizing images-only prompts, one per concurrent caller."""
        from transformers import AutoTokenizer
        self.model_dir = model_dir
        self.pin_pixels = pin_pixels
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        self.spec = MRopeSpec.from_hf_config(hf_config)
        self._processor = None
        self.loading = threading.Lock()
        self.norms: dict[str, PixelNorm] = {}
        self.on_media: Callable[[list[MMItem]], None] | None = None  # items without prompt positions yet
        self.tokenizing = ThreadPoolExecutor(workers, thread_name_prefix="trtllm-qwenvl-tokenize")

    @property
    def processor(self):
        # Loaded on first media prompt (text-only serving never pays for it), once: preprocessing threads race here.
        with self.loading:
            if self._processor is None:
                from transformers import AutoProcessor
                processor = AutoProcessor.from_pretrained(self.model_dir)
                self.norms = {"image": PixelNorm.of(processor.image_processor)}
                if getattr(processor, "video_processor", None) is not None:
                    self.norms["video"] = PixelNorm.of(processor.video_processor)
                self._processor = processor
        return self._processor

    def __call__(self, prompt) -> ProcessedPrompt:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        media = {k: as_list(v) for k, v in (prompt.get("multi_modal_data") or {}).items() if as_list(v)}
        unknown = set(media) - set(PLACEHOLDERS)
        if unknown:
            raise ValueError(f"unsupported modality {sorted(unknown)}; supported: {sorted(PLACEHOLDERS)}")
        if "prompt_token_ids" in prompt:
            if media:
                raise ValueError("multi_modal_data needs a text prompt with placeholders, not prompt_token_ids")
            return self.text_only(list(prompt["prompt_token_ids"]), None)
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'")
        check_placeholders(text, media)
        if not media:
            return self.text_only(self.tokenizer(text)["input_ids"], text)
        return self.multimodal(text, media, media_uuids(prompt, media))

    def text_only(self, token_ids: list[int], text: str | None) -> ProcessedPrompt:
        if not token_ids:
            raise ValueError("the prompt is empty")
        return ProcessedPrompt(token_ids, [], text_positions(len(token_ids)), 0, text)

    def multimodal(self, text: str, media: dict, uuids: dict) -> ProcessedPrompt:
        images = media.get("image", [])
        videos = [Video.of(v) for v in media.get("video", [])]
        out = self.process(text, images, videos, uuids)
        ids = np.asarray(out["input_ids"][0])
        grids = {"image": on_host(out["image_grid_thw"]) if images else None,
                 "video": on_host(out["video_grid_thw"]) if videos else None}
        seconds = on_host(out["second_per_grid_ts"]).astype(np.float64) if "second_per_grid_ts" in out else None
        positions, delta = get_rope_index(self.spec, ids, grids["image"], grids["video"], seconds)
        items = [replace(i, positions=places) for modality, found in out["items"].items()
                 for i, places in zip(found, self.places(ids, modality, found))]
        return ProcessedPrompt(ids.tolist(), items, positions, delta, text)

    def process(self, text: str, images: list, videos: list[Video], uuids: dict):
        """Token ids and raw pixels (resized and patchified, not rescaled or normalised) with the HF processor's
        output keys: ids as lists (HF's tensor conversion walks them in Python, about 3 ms per 1k tokens), pixels as
        CPU tensors; and under "items" the media items, announced to `on_media` as soon as their pixels exist.
        Media it cannot process raise ValueError."""
        try:
            if videos:
                return self.process_videos(text, images, videos, uuids)
            return self.process_images(text, images, uuids)
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"could not process the media: {e}") from e

    def process_videos(self, text: str, images: list, videos: list[Video], uuids: dict):
        """The whole HF processor: the text it writes for a video (per-frame timestamps) is its own."""
        kwargs = {"videos": [v.frames for v in videos],
                  "video_metadata": [{"fps": v.fps, "total_num_frames": len(v.frames),
                                      "frames_indices": list(range(len(v.frames)))} for v in videos],
                  "videos_kwargs": {"return_tensors": "pt", "do_sample_frames": False, **RAW}}
        if images:
            kwargs["images"] = images
            kwargs["images_kwargs"] = {"return_tensors": "pt", **RAW}
        out = self.processor(text=[text], **kwargs)
        out["items"] = self.announce(self.items_of(out, uuids))
        return out

    def process_images(self, text: str, images: list, uuids: dict) -> dict:
        """`process` for images alone, with the HF processor's output keys: the image processor's pixels and grids,
        and the prompt tokenized as written with each placeholder repeated to its image's token count. Special
        tokens are split off before BPE, so the ids equal those of the expanded text; skipping the HF processor's
        kwargs handling and the repeats' tokenization saved 0.65-1.0 ms per 1000-token prompt on the H100 host
        (perf/results/experiments_*). Images the processor would keep at their size skip it: the device patchifies
        them (`pixels.DevicePatchify`). The text is tokenized on another thread meanwhile: in-process A/B on two
        H100 hosts, preprocessing took 0.4-0.6 ms less, and TTFT 0.6 ms less on the slower host (within noise on
        the faster one, whose TTFT waits on the GPU; perf/results/experiments_*)."""
        tokens = self.tokenizing.submit(self.tokenizer, text)
        patchify = DevicePatchify.of(self.processor.image_processor, images)
        if patchify is None:
            out = self.processor.image_processor(images=images, return_tensors="pt", **RAW)
            items = self.items_of(out, uuids)
        else:
            items = {"image": self.whole_images(images, patchify, uuids.get("image")), "video": []}
            out = {"image_grid_thw": np.array([item.grid_thw for item in items["image"]])}
        out["items"] = self.announce(items)
        ids = np.asarray(tokens.result()["input_ids"])
        places = ids == self.spec.image_token_id
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[places] = on_host(out["image_grid_thw"]).prod(-1) // self.spec.spatial_merge_size ** 2
        return {"input_ids": [np.repeat(ids, repeats)], **out}

    def announce(self, items: dict[str, list[MMItem]]) -> dict[str, list[MMItem]]:
        """Media items (content-hashed, pixels staged, no prompt positions yet), handed to `on_media` at once."""
        if self.on_media is not None and (items["image"] or items["video"]):
            self.on_media(items["image"] + items["video"])
        return items

    def items_of(self, out, uuids: dict) -> dict[str, list[MMItem]]:
        """The HF processor output's media items."""
        seconds = on_host(out["second_per_grid_ts"]) if "second_per_grid_ts" in out else None
        return {"image": self.pieces("image", out.get("pixel_values"), out.get("image_grid_thw"), None,
                                     uuids.get("image")),
                "video": self.pieces("video", out.get("pixel_values_videos"), out.get("video_grid_thw"), seconds,
                                     uuids.get("video"))}

    def whole_images(self, images: list, patchify: DevicePatchify, uuids) -> list[MMItem]:
        """Items holding the images themselves, (H, W, 3) uint8, for the device to patchify."""
        items = []
        for i, image in enumerate(images):
            array = np.asarray(image)  # read-only, over the bytes PIL copied out
            pixels = torch.empty(array.shape, dtype=torch.uint8, pin_memory=self.pin_pixels)
            pixels.numpy()[...] = array  # the one copy to the staging memory
            grid = patchify.grid(pixels)
            key = hash_media("image", pixels, grid, 0.0, uuids[i] if uuids else None)
            items.append(MMItem("image", pixels, self.norms["image"], grid, NO_POSITIONS, key, patchify))
        return items

    def pieces(self, modality: str, pixels, grids, seconds, uuids) -> list[MMItem]:
        if grids is None:
            return []
        pixels = pixels.pin_memory() if self.pin_pixels else pixels
        items, patch = [], 0
        for i, grid in enumerate(on_host(grids)):
            grid = tuple(int(g) for g in grid)
            n_patches = int(np.prod(grid))
            px = pixels[patch:patch + n_patches]
            extra = float(seconds[i]) if seconds is not None else 0.0
            key = hash_media(modality, px, grid, extra, uuids[i] if uuids else None)
            items.append(MMItem(modality, px, self.norms[modality], grid, NO_POSITIONS, key))
            patch += n_patches
        return items

    def places(self, ids: np.ndarray, modality: str, items: list[MMItem]) -> list[np.ndarray]:
        """Each item's prompt indices: its run of the modality's placeholder token, in order."""
        token = self.spec.image_token_id if modality == "image" else self.spec.video_token_id
        found = np.flatnonzero(ids == token)
        merge = self.spec.spatial_merge_size ** 2
        bounds = np.cumsum([0] + [int(np.prod(i.grid_thw)) // merge for i in items])
        return [found[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def on_host(x) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def media_uuids(prompt: dict, media: dict) -> dict[str, list]:
    """Client content ids per modality, one per item (None: hash the pixels)."""
    uuids = {k: as_list(v) for k, v in (prompt.get("multi_modal_uuids") or {}).items()}
    for modality, ids in uuids.items():
        if len(ids) != len(media.get(modality, [])):
            raise ValueError(f"multi_modal_uuids has {len(ids)} {modality} id(s) for "
                             f"{len(media.get(modality, []))} {modality}(s)")
        if any(u is not None and not isinstance(u, str) for u in ids):
            raise ValueError("multi_modal_uuids entries must be strings or None")
    return uuids


def check_placeholders(text: str, media: dict) -> None:
    for modality, placeholder in PLACEHOLDERS.items():
        found, given = text.count(placeholder), len(media.get(modality, []))
        if found != given:
            raise ValueError(f"the prompt has {found} {modality} placeholder(s) {placeholder} "
                             f"but {given} {modality}(s) were given")
