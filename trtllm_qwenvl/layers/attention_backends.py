"""Paged attention backends behind one interface: normalise and rotate q/k, store the step's K/V into the cache,
attend over the pages.

`torch` is the reference (the norm and rotary functions the rest of the model uses, SDPA over gathered pages) and
runs everywhere. `triton` is the GPU path (trtllm_qwenvl.kernels): one prologue kernel (q/k norm, rotary, K/V
store), then the split-K decode kernel or the paged prefill kernel.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .forward_context import AttentionMetadata
from .norm import rms_norm, zero_centred_rms_norm
from .rotary import apply_rotary


@dataclass
class Prologue:
    """What happens to q and k before attention: the per-head norm (`norm`: "none", "rms", "zero_centred") and
    the rotary by the step's cos/sin (N, rotary_dim/2)."""
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    norm: str

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference: (N, heads, D) in, new tensors out."""
        if self.norm != "none":
            q, k = self.normalize(q, self.q_norm), self.normalize(k, self.k_norm)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        fn = rms_norm if self.norm == "rms" else zero_centred_rms_norm
        return fn(x.reshape(-1, x.shape[-1]), weight, self.eps).view(x.shape)


class TorchPagedAttention:
    """Gathers each sequence's pages into a padded (B, max_k) batch and runs one masked SDPA call."""

    name = "torch"
    graph_safe = False  # its plan sizes tensors from the step's host lengths

    @staticmethod
    def reserve(max_batch: int, num_heads: int, head_dim: int, device) -> None:
        pass

    @staticmethod
    def plan(meta: AttentionMetadata) -> dict:
        device = meta.cu_seqlens_q.device
        q_start = meta.cu_seqlens_q[:-1].long()
        q_len = meta.cu_seqlens_q[1:].long() - q_start
        n_tokens = meta.slot_mapping.shape[0]
        q_offsets = torch.arange(meta.max_seqlen_q, device=device)
        q_index = (q_start[:, None] + q_offsets).clamp_(max=n_tokens - 1)
        k_pos = torch.arange(meta.max_seqlen_k, device=device)
        blocks = meta.block_tables.long().index_select(1, k_pos // meta.block_size)
        k_slots = blocks * meta.block_size + k_pos % meta.block_size
        seq_lens_k = meta.seq_lens_k.long()
        q_abs = (seq_lens_k - q_len)[:, None] + q_offsets
        mask = (k_pos <= q_abs[:, :, None]) & (k_pos < seq_lens_k[:, None, None])
        return {"q_index": q_index, "k_slots": k_slots, "mask": mask.unsqueeze(1)}

    @staticmethod
    def forward(q, k, v, prologue: Prologue, k_cache, v_cache, out, scale: float, meta: AttentionMetadata) -> None:
        q, k = prologue.apply(q, k)
        plan = meta.plan
        flat_k = k_cache.view(-1, *k_cache.shape[-2:])
        flat_v = v_cache.view(-1, *v_cache.shape[-2:])
        stored = meta.slot_mapping >= 0  # padding rows of a piecewise-graph step store nothing
        flat_k.index_copy_(0, meta.slot_mapping[stored], k[stored])
        flat_v.index_copy_(0, meta.slot_mapping[stored], v[stored])
        qb = q[plan["q_index"]].transpose(1, 2)
        kb = flat_k[plan["k_slots"]].transpose(1, 2)
        vb = flat_v[plan["k_slots"]].transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=plan["mask"], scale=scale,
                                           enable_gqa=qb.shape[1] != kb.shape[1])
        out.copy_(o.transpose(1, 2)[meta.token_seq, meta.token_pos])


class TritonPagedAttention:
    """Triton kernels on CUDA. A step is a pure decode when every sequence brings exactly one query token; mixed
    and prefill steps take the prefill kernel. The decode path reads no device value on the host and allocates
    nothing per step, so it can be captured in a CUDA graph."""

    name = "triton"
    graph_safe = True

    @staticmethod
    def reserve(max_batch: int, num_heads: int, head_dim: int, device) -> None:
        """Size the split-K workspace for the largest decode batch once, before any graph captures it."""
        from ..kernels.paged_decode import WORKSPACE
        WORKSPACE.reserve(max_batch, num_heads, head_dim, device)

    @staticmethod
    def plan(meta: AttentionMetadata) -> dict:
        # Host ints and tensor shapes only: no device reads.
        decode = meta.max_seqlen_q == 1 and meta.slot_mapping.shape[0] == meta.seq_lens_k.shape[0]
        return {"decode": decode}

    @staticmethod
    def forward(q, k, v, prologue: Prologue, k_cache, v_cache, out, scale: float, meta: AttentionMetadata) -> None:
        # Imported on first use: triton is GPU-only and CPU machines may lack it.
        from ..kernels.paged_decode import paged_decode_attention
        from ..kernels.paged_prefill import paged_prefill_attention
        from ..kernels.qk_rope_store import qk_rope_store
        p = prologue
        q = qk_rope_store(q, k, v, p.cos, p.sin, p.q_norm, p.k_norm, p.eps, p.norm, k_cache, v_cache,
                          meta.slot_mapping)
        if meta.plan["decode"]:
            paged_decode_attention(q, k_cache, v_cache, out, scale, meta.seq_lens_k, meta.block_tables)
        else:
            paged_prefill_attention(q, k_cache, v_cache, out, scale, meta.cu_seqlens_q, meta.seq_lens_k,
                                    meta.block_tables, meta.max_seqlen_q)


BACKENDS = {"torch": TorchPagedAttention, "triton": TritonPagedAttention}
_active = TorchPagedAttention


def select_backend(name: str, device: torch.device):
    """`auto` is triton on CUDA and the torch reference elsewhere."""
    global _active
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    _active = BACKENDS[name]
    return _active


def active_backend():
    return _active
