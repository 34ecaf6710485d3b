"""Fixed slots for the linear-attention state of hybrid models (Qwen3.5), sized once at start like the KV pool.

A slot holds, for every Gated DeltaNet layer, the conv state (C, K-1) in the model dtype and the recurrent state
(H, Dk, Dv) in fp32. The first `max_batch_size` slots belong to running sequences (one each, from admission to
finish or preemption); then come the prefix-cache snapshots (`StateSnapshots`) and one scratch slot, which the
padding rows of a decode CUDA graph update so that they touch no real state.
"""
from collections import deque

import torch

from ..layers.gated_deltanet import GatedDeltaNet
from ..utils.logging import logger
from .state_snapshots import StateSnapshots


def gdn_layers(model) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


def bytes_per_slot(layers: list[GatedDeltaNet], dtype: torch.dtype) -> int:
    conv = sum(m.conv_dim * (m.conv_kernel - 1) for m in layers) * torch.finfo(dtype).bits // 8
    recurrent = sum(m.num_v_heads * m.k_head_dim * m.v_head_dim for m in layers) * 4
    return conv + recurrent


class StatePool:
    def __init__(self, layers: list[GatedDeltaNet], num_seq_slots: int, num_snapshots: int, device, dtype):
        first = layers[0]
        total = num_seq_slots + num_snapshots + 1
        self.conv = torch.zeros(len(layers), total, first.conv_dim, first.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(len(layers), total, first.num_v_heads, first.k_head_dim, first.v_head_dim,
                                     dtype=torch.float32, device=device)
        for layer, conv, recurrent in zip(layers, self.conv, self.recurrent):
            layer.conv_state, layer.recurrent_state = conv, recurrent
        self.free_slots: deque[int] = deque(range(num_seq_slots))
        self.scratch_slot = total - 1
        self.snapshots = StateSnapshots(range(num_seq_slots, self.scratch_slot)) if num_snapshots else None
        self.slot_bytes = bytes_per_slot(layers, dtype)

    def allocate(self) -> int:
        return self.free_slots.popleft()

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Copy every layer's state from slot `src` to `dst` (restoring a snapshot)."""
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]


def build_state_pool(model, max_batch_size: int, num_snapshots: int, device, dtype) -> StatePool | None:
    """The pool for a hybrid model (None for a pure-attention one): a slot per batch entry plus the snapshots."""
    layers = gdn_layers(model)
    if not layers:
        return None
    pool = StatePool(layers, max_batch_size, num_snapshots, device, dtype)
    logger.info("linear-attention state: %d sequence slots + %d prefix snapshots, %.2f MiB each",
                max_batch_size, num_snapshots, pool.slot_bytes / 2 ** 20)
    return pool
