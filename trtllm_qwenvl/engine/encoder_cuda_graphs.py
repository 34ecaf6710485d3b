"""CUDA graphs for the vision tower (`multimodal_config.encoder_cuda_graph`), images and videos alike.

The model side of the protocol is `VisionTower.prepare` (per-grid tensors, eager and cached) and `VisionTower.run`
(the blocks and mergers), which a graph replays on static buffers. This side owns the keys: a graph per power of
two patches (the budget), per power of two up to it bounding the longest frame (the cap), and per bound on the
frame count (`max_items`, which every image batch fits, and `max_frames`), captured largest first in one pool; a
batch takes the smallest budget that holds it, then the smallest cap that holds its longest frame, then the
smaller frame bound that holds its frames.

The cap and the frame bound exist because the varlen kernel launches max-length x segment-count blocks: capped at
the budget, eight 1024-patch images in the 8192 budget would launch 8x the blocks they fill, and every empty
segment slot launches as many blocks as a full one: one 512px image under a 64-frame bound ran its attention in
68 us a block on an H100, where the same kernel on one segment takes 39.5 us (perf/results/experiments_*).
Padding patches form extra segments that attend only among themselves (zero pixels), no longer than the cap (or
than Qwen2.5-VL's window for window segments), and the cu_seqlens tail repeats the budget, i.e. empty segments,
so the segment count and max length are fixed per graph. A batch that fits no graph (too many patches, items or
frames) runs eagerly; `hits` and `misses` count both.

Every graph copies its result into one pair of output buffers sized for the largest budget, so what a graph
allocates is free for the next capture. With outputs kept per graph, the 8B model's 15 graphs allocated 1.10 GiB;
the 30 graphs now allocate 0.21 GiB.

Graphs need the fused varlen ViT attention (CUDA, bf16/fp16): the SDPA-per-segment fallback loops over host
lengths, which a capture would freeze.
"""
import numpy as np
import torch

from ..config import EncoderCudaGraphConfig
from ..kernels.vit_attention import fused_path
from ..layers.vision_attention import Segments
from ..models.base import VisionOutput
from ..models.vision_common import VisionInputs, from_attention_order, to_attention_order
from ..utils.logging import logger


def budgets(config: EncoderCudaGraphConfig) -> list[int]:
    sizes, size = [], config.min_tokens
    while size < config.max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [config.max_tokens]


def caps(budget: int, budgets_: list[int]) -> list[int]:
    return [b for b in budgets_ if b <= budget]


def frame_bounds(config: EncoderCudaGraphConfig) -> list[int]:
    return sorted({min(config.max_items, config.max_frames), config.max_frames})


class StaticInputs:
    """One graph's inputs: the front rows of the shared buffers, `budget` patch rows in all."""

    def __init__(self, buffers: dict, budget: int, cap: int, frames: int, tower):
        self.pixels = buffers["pixels"][:budget]
        self.cos, self.sin = buffers["cos"][:budget], buffers["sin"][:budget]
        self.pos = buffers["pos"][:budget] if "pos" in buffers else None
        self.cu = {kind: buf[:segment_slots(kind, budget, cap, tower.unit, frames)]
                   for kind, buf in buffers["cu"].items()}
        self.max_len = {kind: tower.max_segment.get(kind, cap) for kind in self.cu}
        self.segments = {kind: Segments([], cu, self.max_len[kind]) for kind, cu in self.cu.items()}
        self.inputs = VisionInputs(self.cos, self.sin, self.pos, None, {})

    def cu_seqlens(self, kind: str, lens: list[int], budget: int) -> np.ndarray | None:
        """Real segments, then padding pieces no longer than the kind's longest segment, then empty segments; None
        when they do not fit the graph's segment slots."""
        pad, piece = budget - sum(lens), self.max_len[kind]
        pieces = [piece] * (pad // piece) + ([pad % piece] if pad % piece else [])
        bounds = np.cumsum([0] + list(lens) + pieces)
        if len(bounds) > self.cu[kind].shape[0]:
            return None
        cu = np.full(self.cu[kind].shape[0], budget, dtype=np.int32)
        cu[:len(bounds)] = bounds
        return cu


def segment_slots(kind: str, budget: int, cap: int, unit: int, frames: int) -> int:
    """cu_seqlens entries per graph: at most `frames` frames plus padding pieces of at most `cap` patches; other
    segments hold at least one merge unit each."""
    return frames + budget // cap + 2 if kind == "frames" else budget // unit + 2


class EncoderGraphs:
    def __init__(self, tower, config: EncoderCudaGraphConfig, dtype: torch.dtype, device: torch.device):
        self.tower = tower
        self.config = config
        self.budgets = budgets(config)
        self.frame_bounds = frame_bounds(config)
        self.keys = [(b, c, f) for b in self.budgets for c in caps(b, self.budgets) for f in self.frame_bounds]
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.statics: dict[tuple[int, int, int], StaticInputs] = {}
        self.staged = None  # (key, grids) whose rotary, positions and cu_seqlens the static buffers hold
        self.output: VisionOutput | None = None  # every graph's result, in rows of merged tokens
        self.hits = self.misses = 0
        self.buffers = self.allocate(dtype, device)

    @staticmethod
    def usable(dtype: torch.dtype, device: torch.device) -> bool:
        return fused_path(torch.empty(0, dtype=dtype, device=device)) is not None

    def allocate(self, dtype, device) -> dict:
        """Shared buffers sized for the largest budget, filled by probing the tower once for its input shapes."""
        probe = self.tower.prepare([(1, 2 * self.tower.merge, 2 * self.tower.merge)])
        n = self.budgets[-1]
        patch_dim = self.tower.patch_embed.in_features
        buffers = {
            "pixels": torch.zeros(n, patch_dim, dtype=dtype, device=device),
            "cos": torch.ones(n, probe.cos.shape[1], dtype=probe.cos.dtype, device=device),
            "sin": torch.zeros(n, probe.sin.shape[1], dtype=probe.sin.dtype, device=device),
            "cu": {kind: torch.zeros(segment_slots(kind, n, self.budgets[0], self.tower.unit, self.config.max_frames),
                                     dtype=torch.int32, device=device) for kind in probe.segments},
        }
        if probe.pos is not None:
            buffers["pos"] = torch.zeros(n, probe.pos.shape[1], dtype=probe.pos.dtype, device=device)
        return buffers

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for key in reversed(self.keys):
            static = self.statics[key] = StaticInputs(self.buffers, *key, self.tower)
            for kind, cu in static.cu.items():  # padding covers the whole budget
                cu.copy_(torch.from_numpy(static.cu_seqlens(kind, [], key[0])))
            warm = self.tower.run(static.pixels, static.inputs, static.segments)  # compiles outside the capture
            if self.output is None:  # the largest budget comes first
                self.output = VisionOutput(torch.empty_like(warm.embeds), None if warm.deepstack is None
                                           else torch.empty_like(warm.deepstack))
            del warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.publish(self.tower.run(static.pixels, static.inputs, static.segments))
            self.graphs[key] = graph
        torch.cuda.synchronize()
        self.staged = None
        logger.info("vision encoder CUDA graphs captured for budgets %s patches, each with frame caps up to it and "
                    "frame bounds %s (%d graphs; at most %d items)", self.budgets, self.frame_bounds, len(self.keys),
                    self.config.max_items)

    def publish(self, out: VisionOutput) -> None:
        rows = out.embeds.shape[0]
        self.output.embeds[:rows].copy_(out.embeds)
        if out.deepstack is not None:
            self.output.deepstack[:, :rows].copy_(out.deepstack)

    def key_for(self, num_patches: int, grids: list[tuple[int, int, int]],
                segments: dict[str, list[int]]) -> tuple[int, int, int] | None:
        frames = sum(g[0] for g in grids)
        if len(grids) > self.config.max_items or frames > self.config.max_frames:
            return None
        budget = next((b for b in self.budgets if b >= num_patches), None)
        if budget is None:
            return None
        longest = max((max(lens, default=0) for kind, lens in segments.items() if kind not in self.tower.max_segment),
                      default=0)
        return (budget, next(c for c in caps(budget, self.budgets) if c >= longest),
                next(f for f in self.frame_bounds if f >= frames))

    def run(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionOutput | None:
        """The tower's output for these items, or None when no graph fits (the caller runs it eagerly)."""
        inputs = self.tower.prepare(grids)
        key = self.key_for(pixels.shape[0], grids, inputs.segments)
        mark = (key, [tuple(g) for g in grids])
        if mark != self.staged:
            if not self.stage_grids(key, inputs):
                self.misses += 1
                return None
            self.staged = mark
        self.hits += 1
        self.stage_pixels(self.statics[key], to_attention_order(pixels, inputs.order, self.tower.unit))
        self.graphs[key].replay()
        out, rows = self.output, pixels.shape[0] // self.tower.unit
        # Copies: the next replay overwrites the graph's outputs, and the encoder cache keeps these.
        result = VisionOutput(out.embeds[:rows].clone(),
                              None if out.deepstack is None else out.deepstack[:, :rows].clone())
        return from_attention_order(result, inputs.order)

    def stage_grids(self, key: tuple[int, int, int] | None, inputs: VisionInputs) -> bool:
        """Copy what depends only on the grids into the key's static buffers (zero padding pixels, rotary,
        positions, cu_seqlens); False when the batch fits no graph. Repeats of the last staged batch skip this:
        for one 512px image it was half of the host time from its pixels to the replay."""
        if key is None:
            return False
        static = self.statics[key]
        cu = {k: static.cu_seqlens(k, lens, key[0]) for k, lens in inputs.segments.items()}
        if any(c is None for c in cu.values()):
            return False
        n = inputs.cos.shape[0]
        static.pixels[n:].zero_()
        static.cos[:n].copy_(inputs.cos)
        static.sin[:n].copy_(inputs.sin)
        if static.pos is not None:
            static.pos[:n].copy_(inputs.pos)
        for kind, bounds in cu.items():
            static.cu[kind].copy_(torch.from_numpy(bounds).pin_memory(), non_blocking=True)
        return True

    @staticmethod
    def stage_pixels(static: StaticInputs, pixels: torch.Tensor) -> None:
        static.pixels[:pixels.shape[0]].copy_(pixels)
