"""Runs the vision tower once per media item, batched across requests, and caches outputs by content hash.

Items can also be encoded early: the input processor announces them as soon as their pixels exist, and the engine
thread encodes them between steps, while the rest of that request's preprocessing (tokenizer, mRoPE positions)
still runs. When the request arrives its items are cached and its first step goes straight to the LM. An early
output no request has claimed yet is held in arrival order up to `max_unclaimed_tokens` rows (the engine's
`max_num_tokens`); past that the oldest leave the cache (a request that failed after its media were announced never
claims them). An item with more rows than that is left to its request.
"""
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..config import EncoderCudaGraphConfig
from ..models.base import VisionOutput
from ..models.vision_common import joined
from ..utils.device_timer import DeviceTimer
from ..utils.h2d import async_tensor_h2d
from ..utils.logging import logger
from ..utils.nvtx import nvtx_range
from .encoder_cuda_graphs import EncoderGraphs
from .scheduler import ScheduledSeq
from .sequence import MMItem, Sequence


@dataclass
class StepMedia:
    """Vision rows for one step: `rows` of the flat batch get `embeds` (and `deepstack`) in order."""
    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: torch.Tensor | None


class EncoderRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_unclaimed_tokens: int):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.cache: dict[int, VisionOutput] = {}
        self.users: dict[int, set[int]] = {}
        self.unclaimed: OrderedDict[int, int] = OrderedDict()  # early outputs no sequence uses yet: hash -> rows
        self.max_unclaimed_tokens = max_unclaimed_tokens
        self.items_encoded_early = 0
        self.timer = DeviceTimer(device)
        self.items_encoded = 0
        self.graphs: EncoderGraphs | None = None
        self.use_graphs = True  # a switch for benchmarks comparing graphs on and off in one run

    def enable_graphs(self, config: EncoderCudaGraphConfig, dtype: torch.dtype) -> None:
        if self.model.visual is None or not EncoderGraphs.usable(dtype, self.device):
            logger.info("vision encoder CUDA graphs off: they need CUDA, bf16/fp16 and a varlen attention kernel")
            return
        self.graphs = EncoderGraphs(self.model.visual, config, dtype, self.device)
        self.graphs.capture()

    def items_in(self, batch: list[ScheduledSeq]):
        for s in batch:
            for item in s.seq.mm_items:
                lo, hi = item.rows_in(s.start, s.end)
                if hi > lo:
                    yield s, item, lo, hi

    def prepare(self, batch: list[ScheduledSeq]) -> StepMedia | None:
        """Encode the step's not-yet-encoded items in one tower call and return the rows to scatter."""
        needed = list(self.items_in(batch))
        if not needed:
            return None
        todo = {}
        for s, item, _, _ in needed:
            self.users.setdefault(item.hash, set()).add(s.seq.seq_id)
            self.unclaimed.pop(item.hash, None)
            if item.hash not in self.cache:
                todo.setdefault(item.hash, item)
        if todo:
            self.encode(list(todo.values()))
        return self.gather(needed, batch)

    def encode_early(self, items: list[MMItem]) -> None:
        """Encode announced items not cached yet and hold their outputs for the requests to come. One call encodes
        at most `max_unclaimed_tokens` rows, in announcement order: rows past that would be evicted at once, and
        a burst of announcements (many requests arriving together) would otherwise make one eager tower call of
        them all, as large as memory allows or larger."""
        todo, rows = {}, 0
        for item in items:
            n = self.rows(item)
            if item.hash not in self.cache and item.hash not in todo and rows + n <= self.max_unclaimed_tokens:
                todo[item.hash] = item
                rows += n
        if not todo:
            return
        self.encode(list(todo.values()))
        self.items_encoded_early += len(todo)
        for key, item in todo.items():
            self.unclaimed[key] = self.rows(item)
        while sum(self.unclaimed.values()) > self.max_unclaimed_tokens:
            key, _ = self.unclaimed.popitem(last=False)
            self.cache.pop(key, None)

    @torch.inference_mode()
    def encode(self, items: list[MMItem]) -> None:
        with nvtx_range("vision_encode"), self.timer.time():
            pixels = self.upload(items)
            grids = [item.grid_thw for item in items]
            out = self.graphs.run(pixels, grids) if self.graphs is not None and self.use_graphs else None
            if out is None:
                out = self.model.encode(pixels, grids)
        sizes = [self.rows(item) for item in items]
        embeds = out.embeds.split(sizes)
        deepstack = out.deepstack.split(sizes, dim=1) if out.deepstack is not None else [None] * len(items)
        for item, e, d in zip(items, embeds, deepstack):
            self.cache[item.hash] = VisionOutput(e, d)
        self.items_encoded += len(items)

    def rows(self, item: MMItem) -> int:
        """Embedding rows (LM tokens) of an item, known before its prompt positions are."""
        return int(np.prod(item.grid_thw)) // self.model.visual.unit

    def upload(self, items: list[MMItem]) -> torch.Tensor:
        """The items' pixels on the device in the tower's dtype, normalised there from their raw values. Each run of
        items that share a norm (and, for images the device patchifies, a size) is patchified and normalised in one
        go: one item alone takes a dozen torch calls, 0.4-0.6 ms of host time for a 512px image on an H100 host."""
        return joined(self.upload_run(list(run)) for _, run in itertools.groupby(items, key=run_key))

    def upload_run(self, run: list[MMItem]) -> torch.Tensor:
        raw = [async_tensor_h2d(item.pixel_values, item.pixel_values.dtype, self.device) for item in run]
        first = run[0]
        if first.patchify is not None:
            return first.patchify.normalized(torch.stack(raw) if len(raw) > 1 else raw[0][None], first.norm,
                                             self.dtype)
        return first.norm.apply(joined(raw), self.dtype)

    def gather(self, needed, batch: list[ScheduledSeq]) -> StepMedia:
        row_of_start = dict(zip(map(id, batch), np.cumsum([0] + [s.num_tokens for s in batch[:-1]])))
        rows, embeds, deepstack = [], [], []
        for s, item, lo, hi in needed:
            rows.append(item.positions[lo:hi] - s.start + row_of_start[id(s)])
            cached = self.cache[item.hash]
            embeds.append(cached.embeds[lo:hi])
            if cached.deepstack is not None:
                deepstack.append(cached.deepstack[:, lo:hi])
        return StepMedia(async_tensor_h2d(np.concatenate(rows), torch.long, self.device), torch.cat(embeds),
                         torch.cat(deepstack, dim=1) if deepstack else None)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's claim on its items; an item no running request uses leaves the cache."""
        for item in seq.mm_items:
            users = self.users.get(item.hash)
            if users is None:
                continue
            users.discard(seq.seq_id)
            if not users:
                del self.users[item.hash]
                self.cache.pop(item.hash, None)


def run_key(item: MMItem) -> tuple:
    """Items upload together while this stays the same: their norm, and the size of images the device patchifies
    (rows the host patchified concatenate whatever their count)."""
    return id(item.norm), item.patchify is not None and tuple(item.pixel_values.shape)
