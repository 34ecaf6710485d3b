"""Rotary embeddings: multimodal (3-axis) for the LM, 2-axis for the vision towers.

cos/sin tables are computed once at init; a step only gathers rows from them.
"""
import torch
from torch import nn

from .fused import fused_on_cuda


def inverse_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


@fused_on_cuda
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on the first 2*cos.shape[-1] dims of x (..., heads, head_dim); cos/sin are (N, rd/2)."""
    half = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def mrope_axes(mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """Which position axis (0=t, 1=h, 2=w) drives each rotary frequency.

    Sectioned (Qwen2.5-VL): contiguous runs [t..., h..., w...]. Interleaved (Qwen3-VL, Qwen3.5): t,h,w,t,h,w,...
    over the first 3*section entries of each axis, t for the rest.
    """
    n = sum(mrope_section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
    axes = torch.zeros(n, dtype=torch.long)
    for axis in (1, 2):
        axes[axis:mrope_section[axis] * 3:3] = axis
    return axes


class MRotaryEmbedding(nn.Module):
    """positions (3, N) -> cos, sin (N, rotary_dim/2), each frequency read from its own axis."""

    def __init__(self, rotary_dim: int, max_position: int, base: float, mrope_section: list[int],
                 interleaved: bool):
        super().__init__()
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to rotary_dim/2 = {rotary_dim // 2}")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inverse_frequencies(rotary_dim, base))
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)
        self.register_buffer("axes", mrope_axes(mrope_section, interleaved), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.axes.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos_table[positions].gather(0, index).squeeze(0)
        sin = self.sin_table[positions].gather(0, index).squeeze(0)
        return cos, sin


class VisionRotaryTable(nn.Module):
    """Axial 2-D rotary of the vision towers: per patch (h, w) -> cos, sin (S, head_dim/2)."""

    def __init__(self, head_dim: int, base: float = 10000.0, max_side: int = 1024):
        super().__init__()
        freqs = torch.outer(torch.arange(max_side, dtype=torch.float), inverse_frequencies(head_dim // 2, base))
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)
        self.max_side = max_side

    def forward(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hw: (S, 2) long on the table's device, each side below `max_side`."""
        cos = self.cos_table[hw].flatten(1)
        sin = self.sin_table[hw].flatten(1)
        return cos, sin
