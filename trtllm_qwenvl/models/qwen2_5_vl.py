"""Qwen2.5-VL: window-attention ViT with RMSNorm/SwiGLU blocks, on the Qwen2 decoder with sectioned mRoPE."""
import numpy as np
import torch
from torch import nn

from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import VisionRotaryTable
from ..layers.vision_attention import Segments
from ..utils.h2d import async_tensor_h2d
from .base import VisionOutput, VLForCausalLM, build_text_model
from .registry import register
from .vision_common import (GridCache, PatchMerger, VisionBlock, VisionInputs, VisionTower, joined,
                             merge_order_hw)
from .weights import Rule


def window_index(t: int, h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Merge-unit order that groups units into window x window tiles, and each tile's patch count."""
    gh, gw = h // merge, w // merge
    padded = np.full((t, gh + (-gh % window), gw + (-gw % window)), -1)
    padded[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
    nh, nw = padded.shape[1] // window, padded.shape[2] // window
    tiles = padded.reshape(t, nh, window, nw, window).transpose(0, 1, 3, 2, 4).reshape(-1, window * window)
    flat = tiles.reshape(-1)
    lens = (tiles >= 0).sum(-1)
    return flat[flat >= 0], (lens[lens > 0] * merge * merge).tolist()


class Qwen2_5VisionTower(VisionTower):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.unit = self.merge ** 2
        self.window = vc.window_size // self.merge // vc.patch_size
        self.max_segment = {"windows": self.window ** 2 * self.unit}
        self.fullatt = set(vc.fullatt_block_indexes)
        self.patch_embed = nn.Linear(vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, vc.hidden_size,
                                     bias=False)
        self.rotary = VisionRotaryTable(vc.hidden_size // vc.num_heads, vc.rope_parameters["rope_theta"])

        def norm(d):
            return RMSNorm(d, 1e-6)

        self.blocks = nn.ModuleList(
            VisionBlock(vc.hidden_size, vc.num_heads, GatedMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act,
                                                               bias=True), norm)
            for _ in range(vc.depth))
        self.merger = PatchMerger(vc.hidden_size, vc.out_hidden_size, self.merge, norm)
        self.grids = GridCache(self.build_grid)

    def build_grid(self, grid: tuple[int, int, int]) -> dict:
        t, h, w = grid
        if max(h, w) >= self.rotary.max_side:
            raise ValueError(f"image grid {grid} exceeds the vision rotary table ({self.rotary.max_side} patches)")
        order, window_lens = window_index(t, h, w, self.merge, self.window)
        hw = np.tile(merge_order_hw(h, w, self.merge), (t, 1)).reshape(-1, self.unit, 2)[order].reshape(-1, 2)
        device = self.rotary.cos_table.device
        cos, sin = self.rotary(async_tensor_h2d(hw, torch.long, device))
        return {"cos": cos, "sin": sin, "order": async_tensor_h2d(order, torch.long, device),
                "window_lens": window_lens, "frame_lens": [h * w] * t, "units": len(order)}

    def prepare(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        entries = [self.grids.get(tuple(g)) for g in grids]
        offsets = np.concatenate(([0], np.cumsum([e["units"] for e in entries])[:-1]))
        order = torch.cat([e["order"] + int(off) for e, off in zip(entries, offsets)])
        return VisionInputs(joined(e["cos"] for e in entries), joined(e["sin"] for e in entries), None,
                            order, {"frames": sum((e["frame_lens"] for e in entries), []),
                                    "windows": sum((e["window_lens"] for e in entries), [])})

    def run(self, pixels: torch.Tensor, inputs: VisionInputs, segments: dict[str, Segments]) -> VisionOutput:
        """`pixels` in window order; the merged rows come out in window order too."""
        cos_sin = (inputs.cos, inputs.sin)
        x, residual = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)), None
        for i, block in enumerate(self.blocks):
            x, residual = block(x, cos_sin, segments["frames"] if i in self.fullatt else segments["windows"], residual)
        return VisionOutput(self.merger(x + residual))


@register("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLForCausalLM(VLForCausalLM):
    vision_rules = [
        Rule(r"^visual\.patch_embed\.proj\.", "visual.patch_embed.", transform="conv_as_linear"),
        Rule(r"^(visual\.blocks\.\d+\.mlp)\.gate_proj\.", r"\1.gate_up_proj.", shard="gate"),
        Rule(r"^(visual\.blocks\.\d+\.mlp)\.up_proj\.", r"\1.gate_up_proj.", shard="up"),
        Rule(r"^visual\.merger\.ln_q\.", "visual.merger.norm."),
        Rule(r"^visual\.merger\.mlp\.0\.", "visual.merger.linear_fc1."),
        Rule(r"^visual\.merger\.mlp\.2\.", "visual.merger.linear_fc2."),
    ]

    def __init__(self, hf_config):
        language_model = build_text_model(hf_config.text_config, qk_norm=False, interleaved=False)
        super().__init__(hf_config, Qwen2_5VisionTower(hf_config.vision_config), language_model)
