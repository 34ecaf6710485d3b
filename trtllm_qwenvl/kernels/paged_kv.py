"""The inner step shared by the paged prefill and decode kernels: one tile of keys read through the block table,
folded into a running (online-softmax) attention state.

Cache layout: k_cache, v_cache (num_blocks, block_size, kv_heads, head_dim), as the model runner allocates them.
Scores are kept in log2 units (the scale is pre-multiplied by log2 e) so the exponentials are exp2.
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def page_rows(table_row, kpos, kmask, PAGE: tl.constexpr, stride_block, stride_pos):
    """Element offset of each key position's row inside the cache, looked up through the sequence's block table."""
    block = tl.load(table_row + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    return block * stride_block + (kpos % PAGE) * stride_pos


@triton.jit
def attend_tile(acc, m_i, l_i, q, k_head, v_head, table_row, n0, kv_end, q_abs, d,
                stride_block, stride_pos, scale_log2,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDED: tl.constexpr, CAUSAL: tl.constexpr,
                PRECISION: tl.constexpr):
    """Fold keys [n0, n0 + BLOCK_N) into (acc, m_i, l_i).

    BOUNDED masks keys at or past kv_end; CAUSAL masks keys past each row's absolute position q_abs. Tiles that
    need neither skip the mask arithmetic, which is most of them in a long prefill.
    """
    kpos = n0 + tl.arange(0, BLOCK_N)
    kmask = kpos < kv_end
    rows = page_rows(table_row, kpos, kmask, PAGE, stride_block, stride_pos)
    if BOUNDED:
        k = tl.load(k_head + rows[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_head + rows[:, None] + d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if BOUNDED:
        s = tl.where(kmask[None, :], s, float("-inf"))
    if CAUSAL:
        s = tl.where(kpos[None, :] <= q_abs[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if BOUNDED:
        v = tl.load(v_head + rows[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
    else:
        v = tl.load(v_head + rows[:, None] + d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


def dot_precision(dtype) -> str:
    """fp32 inputs get full-precision dots (tests compare them tightly); half types run on the tensor cores."""
    return "ieee" if dtype.itemsize == 4 else "tf32"
