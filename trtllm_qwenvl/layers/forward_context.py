"""Per-step batch metadata that the model runner fills before each forward.

The model's forward sees only flat tensors; everything batch-shaped that attention or deepstack needs lives here,
so no per-request Python runs inside `forward`.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Flat varlen layout: the step's N tokens belong to B sequences, queries first-to-last per sequence."""
    cu_seqlens_q: torch.Tensor      # (B+1,) int32
    seq_lens_k: torch.Tensor        # (B,) int32: KV length of each sequence after this step
    block_tables: torch.Tensor      # (B, max_blocks) int32
    slot_mapping: torch.Tensor      # (N,) int64: where each new token's K/V goes
    token_seq: torch.Tensor         # (N,) int64: owning sequence of each token
    token_pos: torch.Tensor         # (N,) int64: index of each token within its sequence's query chunk
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    plan: dict = field(default_factory=dict)  # backend-derived tensors, computed once per step


@dataclass
class StateMetadata:
    """Where each of the step's B sequences keeps its linear-attention (conv + recurrent) state."""
    slots: torch.Tensor      # (B,) int64: the sequence's slot in the state pool
    # Host copies for the torch reference, which walks the sequences one by one.
    query_lens: list[int]
    slot_list: list[int]
    fresh: list[bool]        # a sequence's first chunk: its state starts at zero
    # Per sequence: (tokens into this chunk, snapshot slot) where the state is also saved for prefix caching.
    snapshots: list[list[tuple[int, int]]]
    # Every sequence brings one token on top of its state and saves no snapshot: one batched update by slot.
    decode: bool = False


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None = None
    # Deepstack features for this step: (levels, N, hidden) rows at visual tokens, zero elsewhere; None when the
    # step carries no visual tokens.
    deepstack: torch.Tensor | None = None
    state: StateMetadata | None = None


_CONTEXT = ForwardContext()


def get_context() -> ForwardContext:
    return _CONTEXT


def set_context(ctx: ForwardContext) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def reset_context() -> None:
    set_context(ForwardContext())
