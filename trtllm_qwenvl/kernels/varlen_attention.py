"""Varlen non-causal attention for the vision towers: each segment (image frame or window) of a packed batch attends
within itself. q, k, v are (S, H, D) views with one row stride (the qkv projection's output, split in place).

The towers' head dims are 72 (Qwen3-VL) and 80 (Qwen2.5-VL); the tiles pad a head to the next power of two and
mask the padding columns out of every load and store. One program owns a tile of one segment's queries for one head
and folds all of the segment's keys into an online softmax (scores in log2 units). On an H100 one 1024-patch image
at head dim 72 took 28.6 us against 37.4 for torch's varlen (FA2, which pads 72 to 96); cuDNN took 22.4 but runs
equal-length batches only (perf/bench_vit_attention.py). A first version split the head into 64 + 16 columns
instead of padding: on the H100 with Triton 3.6 its 16-wide products gave wrong results and illegal addresses
(root cause not found; the 64 + 64 split of head dim 128 was right).

The torch reference is `layers.vision_attention.varlen_attention_reference`.
"""
import torch
import triton
import triton.language as tl

from .paged_kv import LOG2E, dot_precision


@triton.jit
def load_rows(ptrs, row_ok, d_ok, BOUNDED: tl.constexpr, PADDED: tl.constexpr):
    """A tile of rows; masked only where it can run past the segment (BOUNDED) or the head (PADDED)."""
    if BOUNDED and PADDED:
        return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if BOUNDED:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    if PADDED:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def fold_keys(acc, m_i, l_i, q, k_ptr, v_ptr, n0, end, stride_t, d, d_ok, scale_log2, BLOCK_N: tl.constexpr,
              BOUNDED: tl.constexpr, PADDED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold keys [n0, n0 + BLOCK_N) of the segment into the running state; BOUNDED masks keys at or past `end`."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < end
    offs = cols.to(tl.int64)[:, None] * stride_t + d[None, :]
    k = load_rows(k_ptr + offs, col_ok, d_ok, BOUNDED, PADDED)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if BOUNDED:
        s = tl.where(col_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(v_ptr + offs, col_ok, d_ok, BOUNDED, PADDED)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, stride_t, stride_h, stride_ot, stride_oh,
                            scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, HEAD_ALIGN: tl.constexpr, PRECISION: tl.constexpr):
    # A head's tiles are adjacent in launch order, so the segment's keys they all read stay in L2.
    tile, head, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + seg)
    end = tl.load(cu_ptr + seg + 1)
    m0 = start + tile * BLOCK_M
    if m0 >= end:  # past a short segment, or an empty padding segment of a graph
        return
    PADDED: tl.constexpr = BLOCK_D != HEAD_DIM
    q_rows = m0 + tl.arange(0, BLOCK_M)
    q_ok = q_rows < end
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # Triton proves alignment only for arguments divisible by 16; a head of 72 columns starts 8-element aligned,
    # which without the hint costs the loads their vector width (2x slower at head dim 72 than at 80).
    head_off = tl.multiple_of(head * stride_h, HEAD_ALIGN)
    q = tl.load(q_ptr + q_rows.to(tl.int64)[:, None] * stride_t + head_off + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_head, v_head = k_ptr + head_off, v_ptr + head_off
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k_head, v_head, n0, end, stride_t, d, d_ok, scale_log2, BLOCK_N,
                                  False, PADDED, PRECISION)
    if full_end < end:
        acc, m_i, l_i = fold_keys(acc, m_i, l_i, q, k_head, v_head, full_end, end, stride_t, d, d_ok, scale_log2,
                                  BLOCK_N, True, PADDED, PRECISION)
    o = acc / l_i[:, None]
    o_offs = q_rows.to(tl.int64)[:, None] * stride_ot + tl.multiple_of(head * stride_oh, HEAD_ALIGN) + d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def alignment(*strides: int) -> int:
    """The largest power of two up to 16 dividing every stride."""
    align = 16
    while any(s % align for s in strides):
        align //= 2
    return align


def tiles(dtype: torch.dtype, max_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): the best of a sweep at the towers' shapes on an H100 (perf/results/
    experiments_*); segments of at most 64 patches (Qwen2.5-VL's windows) take tiles their size, fp32 (tests) small
    ones that fit the registers."""
    if dtype.itemsize == 4:
        return 64, 32, 4, 2
    return (64, 64, 4, 3) if max_len <= 64 else (128, 128, 8, 3)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q, k, v (S, H, D) with unit stride along D and one shared row stride -> (S, H, D). cu_seqlens (segments + 1,)
    int32 on the device; max_len is the host-side bound on a segment's length that sizes the grid. `config`
    (BLOCK_M, BLOCK_N, warps, stages) overrides the tiles (benchmarks)."""
    assert q.stride() == k.stride() == v.stride() and q.stride(2) == 1
    s, heads, head_dim = q.shape
    out = torch.empty(s, heads, head_dim, device=q.device, dtype=q.dtype)
    segments = cu_seqlens.shape[0] - 1
    if s == 0 or segments <= 0 or max_len <= 0:
        return out
    block_m, block_n, warps, stages = config or tiles(q.dtype, max_len)
    varlen_attention_kernel[(triton.cdiv(max_len, block_m), heads, segments)](
        q, k, v, out, cu_seqlens, q.stride(0), q.stride(1), out.stride(0), out.stride(1), scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_ALIGN=alignment(q.stride(1), out.stride(1)), PRECISION=dot_precision(q.dtype), num_warps=warps,
        num_stages=stages)
    return out
