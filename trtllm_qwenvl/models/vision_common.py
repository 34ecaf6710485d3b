"""Vision-tower pieces shared by the Qwen families: the tower's prepare/run split, blocks, patch mergers, and the
per-grid LRU cache."""
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..layers.mlp import ACTIVATIONS
from ..layers.vision_attention import Segments, VisionAttention


@dataclass
class VisionInputs:
    """Everything a batch of grids adds to the pixels, built from the grid cache without looking at the pixels."""
    cos: torch.Tensor                # (S, head_dim / 2) rotary, patches in attention order
    sin: torch.Tensor
    pos: torch.Tensor | None         # (S, hidden): Qwen3-VL's interpolated position embeddings
    order: torch.Tensor | None       # Qwen2.5-VL: merge units in window order
    segments: dict[str, list[int]]   # patch counts of the attention segments, per kind ("frames", "windows")


class VisionTower(nn.Module):
    """A tower is `prepare(grids)` (per-grid tensors, cached) then `run(pixels, inputs, segments)` (the blocks).

    The split lets the encoder's CUDA graphs replay `run` on static buffers after an eager `prepare`. Towers that
    attend in another order than the processor's (Qwen2.5-VL's windows) permute the pixels in and the rows out.
    """

    unit: int  # patches per LM token (merge x merge)
    max_segment: dict[str, int] = {}  # the longest segment of a kind, where the grid does not bound it

    def prepare(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        raise NotImplementedError

    def run(self, pixels: torch.Tensor, inputs: VisionInputs, segments: dict[str, Segments]):
        raise NotImplementedError

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]):
        inputs = self.prepare(grids)
        segments = {kind: Segments.build(lens, inputs.cos.device) for kind, lens in inputs.segments.items()}
        out = self.run(to_attention_order(pixel_values, inputs.order, self.unit), inputs, segments)
        return from_attention_order(out, inputs.order)


def joined(tensors) -> torch.Tensor:
    """The tensors concatenated; a lone one as it is, not copied (callers only read the result)."""
    tensors = list(tensors)
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def to_attention_order(pixels: torch.Tensor, order: torch.Tensor | None, unit: int) -> torch.Tensor:
    if order is None:
        return pixels
    return pixels.view(-1, unit, pixels.shape[-1])[order].view(-1, pixels.shape[-1])


def from_attention_order(out, order: torch.Tensor | None):
    """Merged rows back in the processor's order (the embeds of a VisionOutput; towers that reorder have no
    deepstack)."""
    if order is None:
        return out
    return type(out)(out.embeds[torch.argsort(order)])


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: Callable[[int], nn.Module]):
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos_sin, segments: Segments, residual: torch.Tensor | None = None):
        """The block on x + residual (x alone when residual is None). Returns the MLP's output and the sum it is
        to be added to, still apart: each residual add runs inside the next norm's kernel, as in the decoder."""
        h, x = self.norm1(x, residual) if residual is not None else (self.norm1(x), x)
        h, x = self.norm2(self.attn(h, cos_sin, segments), x)
        return self.mlp(h), x


class PatchMerger(nn.Module):
    """Merges each merge x merge block of patches into one LM token: norm, then a 2-layer GELU MLP.

    `postshuffle` norms the concatenated block (Qwen3-VL deepstack mergers) instead of each patch.
    """

    def __init__(self, dim: int, out_dim: int, merge: int, norm: Callable[[int], nn.Module],
                 postshuffle: bool = False):
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = norm(self.hidden if postshuffle else dim)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)
        self.act = ACTIVATIONS["gelu"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def merge_order_hw(h: int, w: int, merge: int) -> np.ndarray:
    """(h*w, 2) patch (row, col) in the processor's patch order: merge x merge blocks, row-major inside."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([rows, cols], axis=-1)


class GridCache:
    """LRU of per-(t, h, w) tensors built once on the host and copied once to the device.

    A repeated grid costs a dict lookup: no host index math and no H2D.
    """

    def __init__(self, build: Callable[[tuple[int, int, int]], dict], capacity: int = 256):
        self.build = build
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, grid: tuple[int, int, int]) -> dict:
        if grid in self.entries:
            self.hits += 1
            self.entries.move_to_end(grid)
            return self.entries[grid]
        self.misses += 1
        entry = self.entries[grid] = self.build(grid)
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return entry
