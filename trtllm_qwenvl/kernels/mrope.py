"""mRoPE apply, fused for q and k in one launch, in place.

Each rotary frequency reads its position from one of the three axes (t, h, w); the `axes` table of
`layers.rotary.MRotaryEmbedding` encodes both layouts (sectioned for Qwen2.5-VL, interleaved for Qwen3-VL and
Qwen3.5), so one kernel serves both. cos/sin are gathered from the precomputed fp32 tables inside the kernel and
the rotation runs in fp32. Dims past 2 * rotary_half (partial rotary) are left as they are.
The torch reference is `MRotaryEmbedding.forward` followed by `layers.rotary.apply_rotary` on q and on k.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def rotate_heads(x_ptr, stride_h, num_heads, c, s, f, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate-half of every head of one token by (c, s), one frequency per column."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & (f < HALF)[None, :]
    lo = x_ptr + h[:, None] * stride_h + f[None, :]
    x1 = tl.load(lo, mask=mask).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask).to(tl.float32)
    tl.store(lo, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(lo + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mrope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, axes_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_pos_axis, stride_table, num_q_heads, num_k_heads,
                 HALF: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    f_ok = f < HALF
    axis = tl.load(axes_ptr + f, mask=f_ok, other=0)
    pos = tl.load(pos_ptr + axis * stride_pos_axis + token, mask=f_ok, other=0)
    c = tl.load(cos_ptr + pos * stride_table + f, mask=f_ok, other=1.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_table + f, mask=f_ok, other=0.0)[None, :]
    rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, c, s, f, HALF, BLOCK_QH)
    rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, c, s, f, HALF, BLOCK_KH)


def apply_mrope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, axes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, H, D), k (N, Hkv, D) rotated in place and returned; positions (3, N); tables (max_pos, half)."""
    n, num_q_heads, _ = q.shape
    half = cos_table.shape[1]
    if n == 0:
        return q, k
    mrope_kernel[(n,)](
        q, k, positions, cos_table, sin_table, axes, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        positions.stride(0), cos_table.stride(0), num_q_heads, k.shape[1],
        HALF=half, BLOCK_F=triton.next_power_of_2(half), BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]), num_warps=4)
    return q, k
