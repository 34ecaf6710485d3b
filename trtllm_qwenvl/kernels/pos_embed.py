"""Qwen3-VL position embeddings: the learned side x side grid resampled bilinearly (align_corners=True) to an
h x w patch grid, written straight into the processor's patch order (merge x merge blocks, row-major inside) and
repeated for each of the t frames.

Every index and weight is derived in the kernel from the output row, so a new grid costs one launch: no host
index math and no H2D. The arithmetic follows the reference step for step in fp32 (the source coordinate is a
correctly rounded division, as numpy's), so the taps and weights match it.
The torch reference is `models.qwen3_vl.bilinear_taps` over `models.vision_common.merge_order_hw`, then the
embedding lookup and weighted sum of `Qwen3VisionTower.build_grid`.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def axis_taps(pos, size, SIDE: tl.constexpr):
    """Two grid taps along one axis and their weights, for patch coordinate `pos` of an axis of `size` patches."""
    src = tl.math.div_rn((pos * (SIDE - 1)).to(tl.float32), tl.maximum(size - 1, 1).to(tl.float32))
    lo = tl.floor(src)
    frac = src - lo
    w0 = tl.maximum(1.0 - tl.abs(frac), 0.0)
    w1 = tl.maximum(1.0 - tl.abs(frac - 1.0), 0.0)
    t0 = lo.to(tl.int32)
    return t0, tl.minimum(t0 + 1, SIDE - 1), w0, w1


@triton.jit
def add_tap(acc, table_ptr, index, weight, c, mask, stride_table):
    emb = tl.load(table_ptr + index.to(tl.int64)[:, None] * stride_table + c[None, :], mask=mask, other=0.0)
    return acc + emb.to(tl.float32) * weight[:, None]


@triton.jit
def pos_embed_kernel(table_ptr, out_ptr, rows, h, w, stride_table, stride_out, dim,
                     MERGE: tl.constexpr, SIDE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = r < rows
    # Output row -> (row, col) of the patch grid in merge order; frames repeat the first frame's rows.
    p = r % (h * w)
    unit, inner = p // (MERGE * MERGE), p % (MERGE * MERGE)
    units_w = w // MERGE
    row = (unit // units_w) * MERGE + inner // MERGE
    col = (unit % units_w) * MERGE + inner % MERGE
    h0, h1, hw0, hw1 = axis_taps(row, h, SIDE)
    c0, c1, cw0, cw1 = axis_taps(col, w, SIDE)
    mask = r_ok[:, None] & (c < dim)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc = add_tap(acc, table_ptr, h0 * SIDE + c0, hw0 * cw0, c, mask, stride_table)
    acc = add_tap(acc, table_ptr, h0 * SIDE + c1, hw0 * cw1, c, mask, stride_table)
    acc = add_tap(acc, table_ptr, h1 * SIDE + c0, hw1 * cw0, c, mask, stride_table)
    acc = add_tap(acc, table_ptr, h1 * SIDE + c1, hw1 * cw1, c, mask, stride_table)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def interpolated_pos_embed(table: torch.Tensor, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """table (side*side, C) -> (t*h*w, C) in the table's dtype, rows in the processor's patch order."""
    t, h, w = grid
    side = int(round(table.shape[0] ** 0.5))
    rows, dim = t * h * w, table.shape[1]
    out = torch.empty(rows, dim, dtype=table.dtype, device=table.device)
    block_r, block_c = 16, 128
    grid_dims = (triton.cdiv(rows, block_r), triton.cdiv(dim, block_c))
    pos_embed_kernel[grid_dims](table, out, rows, h, w, table.stride(0), out.stride(0), dim,
                                MERGE=merge, SIDE=side, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out
