"""Qwen3-VL: ViT with a learned, bilinearly resampled position grid and deepstack mergers, on the Qwen3 decoder
with interleaved mRoPE. Deepstack features are added after the first decoder layers."""
import numpy as np
import torch
from torch import nn

from ..layers.mlp import MLP
from ..layers.norm import LayerNorm
from ..layers.rotary import VisionRotaryTable
from ..layers.vision_attention import Segments
from ..utils.h2d import async_tensor_h2d
from .base import VisionOutput, VLForCausalLM, build_text_model
from .registry import register
from .vision_common import (GridCache, PatchMerger, VisionBlock, VisionInputs, VisionTower, joined,
                             merge_order_hw)
from .weights import Rule


def bilinear_taps(hw: np.ndarray, h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (S, 4) into the side x side learned grid and their weights, align_corners=True."""
    def axis(pos, size):
        src = pos * (side - 1) / max(size - 1, 1)
        lo = np.floor(src)
        taps = np.stack([lo, lo + 1], -1).clip(0, side - 1).astype(np.int64)
        dist = np.abs(src[:, None] - lo[:, None] - np.array([0, 1], np.float32))
        return taps, (1 - dist).clip(min=0).astype(np.float32)

    h_taps, h_w = axis(hw[:, 0].astype(np.float32), h)
    w_taps, w_w = axis(hw[:, 1].astype(np.float32), w)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return index, weight


class Qwen3VisionTower(VisionTower):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.unit = self.merge ** 2
        self.side = int(vc.num_position_embeddings ** 0.5)
        self.patch_embed = nn.Linear(vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, vc.hidden_size)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.rotary = VisionRotaryTable(vc.hidden_size // vc.num_heads, vc.rope_parameters["rope_theta"])

        def norm(d):
            return LayerNorm(d, eps=1e-6)

        self.blocks = nn.ModuleList(
            VisionBlock(vc.hidden_size, vc.num_heads, MLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act), norm)
            for _ in range(vc.depth))
        self.merger = PatchMerger(vc.hidden_size, vc.out_hidden_size, self.merge, norm)
        # Qwen3.5 reuses this tower without deepstack.
        self.deepstack_indexes = list(getattr(vc, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(vc.hidden_size, vc.out_hidden_size, self.merge, norm, postshuffle=True)
            for _ in self.deepstack_indexes)
        self.grids = GridCache(self.build_grid)

    def build_grid(self, grid: tuple[int, int, int]) -> dict:
        t, h, w = grid
        if max(h, w) >= self.rotary.max_side:
            raise ValueError(f"image grid {grid} exceeds the vision rotary table ({self.rotary.max_side} patches)")
        hw = merge_order_hw(h, w, self.merge)
        index, weight = bilinear_taps(hw, h, w, self.side)
        device = self.pos_embed.weight.device
        taps = self.pos_embed(async_tensor_h2d(index, torch.long, device))
        pos = (taps * async_tensor_h2d(weight, torch.float32, device)[:, :, None]).sum(1)
        cos, sin = self.rotary(async_tensor_h2d(hw, torch.long, device))
        return {"cos": cos.repeat(t, 1), "sin": sin.repeat(t, 1), "pos": pos.to(taps.dtype).repeat(t, 1),
                "frame_lens": [h * w] * t}

    def prepare(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        entries = [self.grids.get(tuple(g)) for g in grids]
        return VisionInputs(joined(e["cos"] for e in entries), joined(e["sin"] for e in entries),
                            joined(e["pos"] for e in entries), None,
                            {"frames": sum((e["frame_lens"] for e in entries), [])})

    def run(self, pixels: torch.Tensor, inputs: VisionInputs, segments: dict[str, Segments]) -> VisionOutput:
        cos_sin = (inputs.cos, inputs.sin)
        x, residual = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)) + inputs.pos, None
        deepstack = []
        for i, block in enumerate(self.blocks):
            x, residual = block(x, cos_sin, segments["frames"], residual)
            if i in self.deepstack_indexes:
                x, residual = x + residual, None
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        x = x + residual if residual is not None else x
        return VisionOutput(self.merger(x), torch.stack(deepstack) if deepstack else None)


@register("Qwen3VLForConditionalGeneration")
class Qwen3VLForCausalLM(VLForCausalLM):
    vision_rules = [Rule(r"^visual\.patch_embed\.proj\.weight", "visual.patch_embed.weight",
                         transform="conv_as_linear"),
                    Rule(r"^visual\.patch_embed\.proj\.bias", "visual.patch_embed.bias")]

    def __init__(self, hf_config, mlp_for_layer=None):
        language_model = build_text_model(hf_config.text_config, qk_norm=True, interleaved=True,
                                          mlp_for_layer=mlp_for_layer)
        super().__init__(hf_config, Qwen3VisionTower(hf_config.vision_config), language_model)
        self.num_deepstack_levels = len(hf_config.vision_config.deepstack_visual_indexes)
