"""Paged attention for decode steps (one query token per sequence), split-K over the context, CUDA-graph safe.

A batch of a few long sequences gives too few (sequence, KV head) programs to fill the GPU, so each sequence's
context is cut into `num_splits` equal ranges attended in parallel, and the partial results are merged by their
log-sum-exp. The merge runs in the same launch: each split program writes its partial, counts its arrival on a
per-(sequence, KV head) counter, and the program that arrives last merges all of them and resets the counter
(a separate merge kernel cost a launch per layer, a tenth of a decode step's attention at batch 1). The merge reads
the splits in a fixed order, so the result does not depend on which program finished last. Graph safety:
- the split count depends only on host shapes (batch size, KV heads), so it is fixed per captured batch size;
- each split's range is derived on the device from seq_lens_k: no host reads, no data-dependent host control;
  a split covers at least MIN_SPLIT_KEYS keys, so a short context uses fewer of the launched splits (the others
  return at once, and the merge waits for and reads only the used ones). Each split costs a fixed latency of a few
  microseconds: on an H100 at batch 1 over 1000 keys, 8 splits took 8.8 us a layer and all 32 took 13.7;
- the partials and counters live in a workspace sized once (`reserve`) and sliced per batch, never allocated per
  step; the counters return to zero at the end of every launch.
The torch reference is `layers.attention_backends.TorchPagedAttention`.
"""
import functools

import torch
import triton
import triton.language as tl

from .paged_kv import LOG2E, attend_tile, dot_precision
from .pdl import enter, launch_args

MAX_SPLITS = 32  # a power of two: the merge loads all slots, masked
MIN_SPLIT_KEYS = 128  # a multiple of every BLOCK_N (perf/results/experiments_h100_2026-11-24_decode_splits.md)


@triton.jit
def decode_split_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, arrivals_ptr, seq_lens_ptr,
                        tables_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_block, stride_pos, stride_head,
                        stride_table, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_arr,
                        scale_log2, num_splits, MIN_SPLIT_KEYS: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_S: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT_KEYS)
    used = tl.maximum(tl.cdiv(kv_len, per_split), 1)  # an empty sequence (padding row) keeps split 0 to write zeros
    if split >= used:
        return
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    g = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + g
    row_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_ptr + kv_head * stride_head, v_ptr + kv_head * stride_head,
                                    table_row, n0, end, g, d, stride_block, stride_pos, scale_log2,
                                    PAGE, BLOCK_N, True, False, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (seq.to(tl.int64) * stride_ot + head * stride_oh)[:, None] + d[None, :]
    if DIRECT:  # a single split writes the final output
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # An empty split (short context) reports lse = -inf and drops out of the merge.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        po_rows = seq.to(tl.int64) * stride_po_b + head * stride_po_h
        lse_rows = part_lse_ptr + seq * stride_pl_b + head * stride_pl_h
        tl.store(part_o_ptr + (po_rows + split * stride_po_s)[:, None] + d[None, :], o, mask=row_ok[:, None])
        tl.store(lse_rows + split, lse, mask=row_ok)
        # All threads' partials are written before one thread's release-ordered arrival publishes them (the
        # barrier orders them before it); the last arrival's acquire then makes every split's partial visible.
        # Every used split must arrive, an empty one included: no return between the `used` check and here.
        tl.debug_barrier()
        counter = arrivals_ptr + seq * stride_arr + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
            merged = merge_splits(part_o_ptr, lse_rows, po_rows, stride_po_s, used, row_ok, d,
                                  BLOCK_G, HEAD_DIM, BLOCK_S)
            tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(counter, 0)


@triton.jit
def merge_splits(part_o_ptr, lse_rows, po_rows, stride_po_s, num_splits, row_ok, d, BLOCK_G: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Each head's output from its splits' partials, weighted by their softmax mass. Loads skip L1 (.cg): the
    partials were written by other SMs during this launch."""
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_rows[:, None] + s[None, :], mask=row_ok[:, None] & (s < num_splits)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # empty sequence (padding row): every weight is zero
    total = tl.sum(tl.exp2(lse - top[:, None]), 1)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for split in range(num_splits):
        w = tl.exp2(tl.load(lse_rows + split, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - top)
        part = tl.load(part_o_ptr + (po_rows + split * stride_po_s)[:, None] + d[None, :], mask=row_ok[:, None],
                       other=0.0, cache_modifier=".cg")
        acc += part * w[:, None]
    return acc / tl.where(total > 0, total, 1.0)[:, None]


class Workspace:
    """Split-K partials and arrival counters, sized by the largest batch once and sliced per call (no allocation
    inside a graph)."""

    def __init__(self):
        self.part_o = torch.empty(0)
        self.part_lse = torch.empty(0)
        self.arrivals = torch.empty(0)

    def reserve(self, max_batch: int, num_heads: int, head_dim: int, device) -> None:
        """Call at engine start with the largest decode batch; later calls only grow it (eager steps)."""
        want = (max_batch, num_heads, MAX_SPLITS, head_dim)
        have = self.part_o.shape
        if len(have) == 4 and self.part_o.device == torch.device(device) and all(
                h >= w for h, w in zip(have, want)):
            return
        self.part_o = torch.empty(want, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(want[:3], dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(want[:2], dtype=torch.int32, device=device)  # one per (sequence, KV head)


WORKSPACE = Workspace()


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs for about two waves; a function of host shapes only."""
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sm_count(device), batch * kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           scale: float, seq_lens_k: torch.Tensor, block_tables: torch.Tensor,
                           splits: int | None = None) -> None:
    """out[b] = attention of q[b] (one token of sequence b) over its cached keys; q, out (B, H, D)."""
    batch, num_heads, head_dim = q.shape
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // kv_heads
    splits = splits or num_splits(batch, kv_heads, q.device)
    assert 1 <= splits <= MAX_SPLITS, f"splits must be 1..{MAX_SPLITS}, got {splits}"
    WORKSPACE.reserve(batch, num_heads, head_dim, q.device)
    ws = WORKSPACE
    decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, out, ws.part_o, ws.part_lse, ws.arrivals, seq_lens_k, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        ws.part_o.stride(0), ws.part_o.stride(1), ws.part_o.stride(2), ws.part_lse.stride(0), ws.part_lse.stride(1),
        ws.arrivals.stride(0), scale * LOG2E, splits, MIN_SPLIT_KEYS=MIN_SPLIT_KEYS, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=64 if head_dim <= 128 else 32, BLOCK_S=MAX_SPLITS, DIRECT=splits == 1,
        PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=3, **launch_args(q.device))
