"""Paged attention for prefill (and mixed) steps: varlen queries over the paged KV cache, causal within the new
chunk, every cached-prefix key visible, GQA.

One program owns a tile of query tokens of one sequence for one KV head, and stacks that head's whole query group
into the tile's rows (row r = token r // group, head r % group): each K/V tile is loaded once for the group
instead of once per query head. The torch reference is `layers.attention_backends.TorchPagedAttention`.

Under the causal mask a tile's work grows with its position, so launch order matters. For chunks of up to 4096
tokens the grid runs heaviest first with the KV heads fastest: every head's last tile starts in the first wave and
the light tiles fill the tail. One 1000-token chunk at the Qwen3-VL-8B shape took 32.9 us against 44.9 in
position order on an H100 (perf/results/experiments_*). Longer chunks keep position order with a head's tiles
adjacent, whose shared key prefix stays in L2: at 8192 tokens heaviest-first was 6% slower.
"""
import torch
import triton
import triton.language as tl

from .paged_kv import LOG2E, attend_tile, dot_precision

HEAVY_FIRST_MAX_TOKENS = 4096


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, tables_ptr,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_block, stride_pos, stride_head, stride_table,
                   scale_log2,
                   GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    if HEAVY_FIRST:
        kv_head, seq = tl.program_id(0), tl.program_id(2)
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        tile, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    m0 = tile * TOKENS
    if m0 >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    context = kv_len - q_len  # cached prefix plus earlier chunks: visible to every query of this chunk

    r = tl.arange(0, BLOCK_M)
    tok = m0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < q_len)
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    q_abs = context + tok

    table_row = tables_ptr + seq.to(tl.int64) * stride_table
    k_head = k_ptr + kv_head * stride_head
    v_head = v_ptr + kv_head * stride_head
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys before the tile's first query are visible to all its rows: no mask. The rest straddle the diagonal.
    open_end = (context + m0) // BLOCK_N * BLOCK_N
    for n0 in range(0, open_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_head, v_head, table_row, n0, kv_len, q_abs, d,
                                    stride_block, stride_pos, scale_log2, PAGE, BLOCK_N, False, False, PRECISION)
    diag_end = tl.minimum(kv_len, context + m0 + TOKENS)
    for n0 in range(open_end, diag_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_head, v_head, table_row, n0, kv_len, q_abs, d,
                                    stride_block, stride_pos, scale_log2, PAGE, BLOCK_N, True, True, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tiles(dtype: torch.dtype, head_dim: int, group: int) -> dict:
    """Tile shape: wide rows for half types at head_dim <= 128; fp32 (tests) and head_dim 256 (Qwen3.5) halve the
    tiles to stay inside registers and shared memory."""
    small = dtype.itemsize == 4 or head_dim > 128
    block_m, block_n = (64, 32) if small else (128, 64)
    warps = 4 if block_m * head_dim <= 64 * 128 else 8
    block_m = max(block_m, triton.next_power_of_2(group))
    return {"BLOCK_M": block_m, "TOKENS": block_m // group, "BLOCK_N": block_n, "num_warps": warps}


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                            scale: float, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                            block_tables: torch.Tensor, max_seqlen_q: int) -> None:
    """out[t] = causal attention of q[t] over its sequence's cached keys; q, out (N, H, D); caches already hold
    this step's K/V. `max_seqlen_q` is the host-side bound that sizes the grid."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // kv_heads
    tiles = prefill_tiles(q.dtype, head_dim, group)
    num_tiles, seqs = triton.cdiv(max_seqlen_q, tiles["TOKENS"]), seq_lens_k.shape[0]
    heavy_first = max_seqlen_q <= HEAVY_FIRST_MAX_TOKENS
    grid = (kv_heads, num_tiles, seqs) if heavy_first else (num_tiles, seqs, kv_heads)
    prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens_k, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, GROUP=group, HEAD_DIM=head_dim, PAGE=page, PRECISION=dot_precision(q.dtype),
        HEAVY_FIRST=heavy_first, num_stages=2, **tiles)
