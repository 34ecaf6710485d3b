"""Varlen non-causal attention for the vision towers: each image frame or window attends within itself."""
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.vit_attention import vit_attention
from ..utils.h2d import async_tensor_h2d
from .rotary import apply_rotary


@dataclass
class Segments:
    """Packed segment boundaries, built on the host and copied to the device once."""
    lengths: list[int]
    cu_seqlens: torch.Tensor  # (num_segments + 1,) int32 on the device
    max_len: int

    @classmethod
    def build(cls, lengths: list[int], device) -> "Segments":
        cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        return cls(list(lengths), async_tensor_h2d(cu, torch.int32, device), max(lengths))


def varlen_attention_reference(q, k, v, segments: Segments, scale: float) -> torch.Tensor:
    """q, k, v (S, H, D) -> (S, H, D): SDPA per segment."""
    outs = []
    for qs, ks, vs in zip(*(t.split(segments.lengths) for t in (q, k, v))):
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos_sin, segments: Segments) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotary in fp32, as the reference towers do, then back to the activation dtype. On CUDA one Triton launch
        # rotates q and k in place inside the qkv output: no fp32 copies, no casts back.
        if q.is_cuda:
            from ..kernels.vision_rotary import apply_vision_rotary  # triton: GPU machines only
            q, k = apply_vision_rotary(q, k, *cos_sin)
        else:
            q = apply_rotary(q.float(), *cos_sin).to(x.dtype)
            k = apply_rotary(k.float(), *cos_sin).to(x.dtype)
        out = vit_attention(q, k, v, segments, self.head_dim ** -0.5)
        return self.proj(out.reshape(s, -1))
