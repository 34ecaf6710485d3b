"""Raw pixels: the HF processors resize and patchify on the host, and their rescale and normalise run on the
engine's device.

Normalising a 512px image on the host is three fp32 passes over 3 MB (cast, subtract, divide), multi-threaded
torch ops whose idle CPU threads must be woken for each request, and its fp32 result still had to be cast for
staging. Raw pixels of RGB images stay uint8 through patchify, staging and the H2D copy (half the bytes of bf16).
The device then repeats the processor's own fp32 arithmetic (the same subtract and divide, eagerly, so each value
rounds as on the host): the tower sees HF's pixels exactly. That is the arithmetic of HF's torchvision backend,
which AutoProcessor loads when torchvision is installed (a pinned dependency); the PIL backend rescales and
normalises in two steps, one rounding more.
"""
from dataclasses import dataclass, field

import torch

RAW = {"do_rescale": False, "do_normalize": False}  # processor kwargs: resize and patchify only


@dataclass(frozen=True)
class DevicePatchify:
    """HF's patchify, run where the pixels are, for RGB images their processor would not resize (height and width
    already multiples of patch x merge, pixel count within its bounds). Such an item holds the (H, W, 3) uint8 image
    and the encoder patchifies it on the device: the processor's own permutation, duplicated into the temporal
    slots, from half the bytes (tests/test_input_processor.py holds the result equal to the processor's pixels). On
    the H100 host the image processor took 1.3 ms for a 512px image, most of it two host copies through a 9-d
    permute; here the host copies the image's bytes once, into pinned memory, and the device's copies cost about
    0.3 ms of a lone image's encode (perf/results/experiments_h100_2026-11-25_599cc14.md)."""
    processor: object = field(repr=False, compare=False)  # the HF image processor whose patchify this is

    @classmethod
    def of(cls, processor, images: list) -> "DevicePatchify | None":
        """The patchify for these images, or None when any one is not an RGB PIL image its processor keeps as is."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        factor = processor.patch_size * processor.merge_size
        size = processor.size

        def kept(image) -> bool:
            return (isinstance(image, Image.Image) and image.mode == "RGB" and smart_resize(
                image.height, image.width, factor, size["shortest_edge"], size["longest_edge"]) == (
                    image.height, image.width))
        return cls(processor) if processor.do_resize and all(map(kept, images)) else None

    def grid(self, image: torch.Tensor) -> tuple[int, int, int]:
        return 1, image.shape[0] // self.processor.patch_size, image.shape[1] // self.processor.patch_size

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B, H, W, 3) images of one size -> their raw patch rows, image after image (B * N, 3 * T * P * P), as the
        processor's output on the host."""
        p = self.processor
        patches, _, _ = p.patchify(images.permute(0, 3, 1, 2), p.patch_size, p.merge_size, p.temporal_patch_size)
        return patches.flatten(0, 1)

    def normalized(self, images: torch.Tensor, norm: "PixelNorm", dtype: torch.dtype) -> torch.Tensor:
        """(B, H, W, 3) images of one size -> the processor's pixels in `dtype`. On CUDA, with a mean and std to
        apply, one Triton launch (`kernels.patch_rows`) in place of this patchify and the norm's four."""
        if images.is_cuda and norm.mean is not None:
            from ..kernels.patch_rows import patch_rows  # triton: GPU machines only
            p = self.processor
            return patch_rows(images, *norm.constants(images.device), p.patch_size, p.merge_size,
                              p.temporal_patch_size, dtype)
        return norm.apply(self(images), dtype)


@dataclass
class PixelNorm:
    """What an HF image or video processor does to pixels after resizing: x * scale when it only rescales, else
    (x - mean) / std in fp32, mean and std divided by the rescale factor when it also rescales (HF fuses the two
    that way). A patch row holds one run of `span` values per channel."""
    span: int
    scale: float | None = None
    mean: torch.Tensor | None = None  # (C,) fp32
    std: torch.Tensor | None = None
    on_device: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, processor) -> "PixelNorm":
        span = processor.temporal_patch_size * processor.patch_size ** 2
        if not processor.do_normalize:
            return cls(span, processor.rescale_factor if processor.do_rescale else None)
        mean, std = torch.tensor(processor.image_mean), torch.tensor(processor.image_std)
        if processor.do_rescale:
            mean, std = mean * (1.0 / processor.rescale_factor), std * (1.0 / processor.rescale_factor)
        return cls(span, None, mean.reshape(-1), std.reshape(-1))  # a scalar mean or std applies to every channel

    def apply(self, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Raw patch rows (N, C * span), on any device -> the processor's pixels in `dtype`."""
        if self.mean is None:
            return (raw * self.scale if self.scale is not None else raw).to(dtype)
        mean, std = self.constants(raw.device)
        x = raw.to(torch.float32, copy=True).view(len(raw), -1, self.span)
        return x.sub_(mean[:, None]).div_(std[:, None]).view(len(raw), -1).to(dtype)

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """mean and std on `device`, copied once and without blocking the host (from pinned memory)."""
        if device not in self.on_device:
            pin = device.type == "cuda"
            self.on_device[device] = tuple(t.pin_memory().to(device, non_blocking=True) if pin else t
                                           for t in (self.mean, self.std))
        return self.on_device[device]
