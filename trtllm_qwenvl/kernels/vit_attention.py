"""ViT attention: varlen, non-causal, each segment (frame or window) attending within itself, in one call.

Order of preference, each only where it can run: our Triton kernel (`kernels.varlen_attention`, Hopper and later,
fp16/bf16), flash_attn (when importable), torch's `torch.nn.attention.varlen.varlen_attn` (torch >= 2.9, CUDA,
fp16/bf16), else SDPA per segment, which is the reference `layers.vision_attention.varlen_attention_reference`.
The Triton kernel comes first only where it was measured faster than FA2 (an H100; perf/results/experiments_*).
"""
import functools
import inspect

import torch

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

# torch 2.9 took no scale (always 1/sqrt(D)); later versions take it as a keyword.
VARLEN_TAKES_SCALE = varlen_attn is not None and "scale" in inspect.signature(varlen_attn).parameters


@functools.cache
def hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def fused_path(q: torch.Tensor) -> str | None:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if hopper_or_later(q.device) and q.shape[-1] <= 128:
        return "triton"
    if flash_attn_varlen_func is not None:
        return "flash_attn"
    if varlen_attn is not None:
        return "varlen"
    return None


def vit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments, scale: float) -> torch.Tensor:
    """q, k, v (S, H, D) -> (S, H, D). `segments` is a `layers.vision_attention.Segments` (device cu_seqlens,
    host lengths and max length)."""
    path = fused_path(q)
    cu, max_len = segments.cu_seqlens, segments.max_len
    if path == "triton":
        from .varlen_attention import varlen_attention  # Triton: GPU machines only
        return varlen_attention(q, k, v, cu, max_len, scale)
    if path == "flash_attn":
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale, causal=False)
    if path == "varlen":
        if VARLEN_TAKES_SCALE:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)
        return varlen_attn(q * (scale * q.shape[-1] ** 0.5), k, v, cu, cu, max_len, max_len)
    # Imported here: layers.vision_attention imports this module.
    from ..layers.vision_attention import varlen_attention_reference
    return varlen_attention_reference(q, k, v, segments, scale)
