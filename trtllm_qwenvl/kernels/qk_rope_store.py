"""The attention prologue in one launch: per-head q/k RMSNorm, rotary on q and k, and the K/V store into the cache.

Written in torch these are five kernels per layer (two norms, two rotations, the store) that each read the step's
q or k; at a decode step each costs more in launch and ramp-up than in bytes. One program per token loads the
token's q and k heads once, normalises and rotates them in fp32, writes q to a fresh contiguous buffer for the
attention kernels, and stores k and v at the token's slot (a negative slot, a graph's padding row, stores nothing).

Rounding follows the torch path the CPU runs (`layers.attention_backends.Prologue.apply`): the standard norm rounds the
normalised value to the activation dtype before the weight, the zero-centred one (Qwen3.5) does not; the rotation
rounds once. Dims past 2 * HALF (partial rotary) are only normalised.
"""
import torch
import triton
import triton.language as tl

from .pdl import enter, launch_args

NORM_MODES = {"none": 0, "rms": 1, "zero_centred": 2}  # the q/k norm classes' `mode` names


@triton.jit
def norm_rope_heads(x_ptr, stride_h, num_heads, w_ptr, c, s, eps, D: tl.constexpr, HALF: tl.constexpr,
                    NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token's heads -> (rotated first half, rotated second half, the rest: normalised, not rotated), fp32, in
    the output dtype's rounding. The rest covers dims [2 * HALF, D)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    f = tl.arange(0, BLOCK_F)[None, :]
    r = tl.arange(0, BLOCK_R)[None, :]
    h_ok = h < num_heads
    f_ok = h_ok & (f < HALF)
    r_ok = h_ok & (2 * HALF + r < D)
    row = x_ptr + h * stride_h
    x1 = tl.load(row + f, mask=f_ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + f, mask=f_ok, other=0.0).to(tl.float32)
    rest = tl.load(row + 2 * HALF + r, mask=r_ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if NORM != 0:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(rest * rest, axis=1)
        inv = tl.rsqrt(ss / D + eps)[:, None]
        w1 = tl.load(w_ptr + f, mask=f < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + f, mask=f < HALF, other=0.0).to(tl.float32)
        wr = tl.load(w_ptr + 2 * HALF + r, mask=2 * HALF + r < D, other=0.0).to(tl.float32)
        if NORM == 1:  # weight * normalised.to(dtype), the product rounded to dtype
            x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            rest = (wr * (rest * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        else:  # (normalised * (1 + weight)).to(dtype)
            x1 = (x1 * inv * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * inv * (1.0 + w2)).to(dtype).to(tl.float32)
            rest = (rest * inv * (1.0 + wr)).to(dtype).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s, rest, h, f, r, f_ok, r_ok


@triton.jit
def store_heads(dst, stride_h, o1, o2, rest, h, f, r, f_ok, r_ok, HALF: tl.constexpr):
    row = dst + h * stride_h
    dtype = dst.dtype.element_ty
    tl.store(row + f, o1.to(dtype), mask=f_ok)
    tl.store(row + HALF + f, o2.to(dtype), mask=f_ok)
    tl.store(row + 2 * HALF + r, rest.to(dtype), mask=r_ok)


@triton.jit
def qk_rope_store_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, cos_ptr, sin_ptr,
                         qw_ptr, kw_ptr, eps, num_q_heads, num_kv_heads,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                         stride_cs, stride_block, stride_pos, stride_head,
                         D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_F: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    c = tl.load(cos_ptr + token * stride_cs + f, mask=f < HALF, other=1.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_cs + f, mask=f < HALF, other=0.0).to(tl.float32)[None, :]
    q1, q2, qr, h, fq, r, f_ok, r_ok = norm_rope_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, qw_ptr, c,
                                                       s, eps, D, HALF, NORM, BLOCK_QH, BLOCK_F, BLOCK_R)
    store_heads(q_out_ptr + token * stride_ot, stride_oh, q1, q2, qr, h, fq, r, f_ok, r_ok, HALF)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    k1, k2, kr, h, fk, r, f_ok, r_ok = norm_rope_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, kw_ptr, c,
                                                       s, eps, D, HALF, NORM, BLOCK_KH, BLOCK_F, BLOCK_R)
    dst = (slot // PAGE) * stride_block + (slot % PAGE) * stride_pos
    store_heads(k_cache_ptr + dst, stride_head, k1, k2, kr, h, fk, r, f_ok, r_ok, HALF)
    hv = tl.arange(0, BLOCK_KH)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    v_ok = (hv < num_kv_heads) & (d < D)
    v = tl.load(v_ptr + token * stride_vt + hv * stride_vh + d, mask=v_ok)
    tl.store(v_cache_ptr + dst + hv * stride_head + d, v, mask=v_ok)


def qk_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, norm: str,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q (N, H, D), k and v (N, Hkv, D), any token/head strides (views of the fused qkv output); cos, sin (N, half);
    norm one of NORM_MODES with its weights (D,); caches (num_blocks, page, Hkv, D). Returns the normalised,
    rotated q, contiguous."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads, half = k.shape[1], cos.shape[1]
    q_out = torch.empty(n, num_q_heads, head_dim, device=q.device, dtype=q.dtype)
    if n == 0:
        return q_out
    weights = (q_norm, k_norm) if norm != "none" else (q, k)  # unused pointers when there is no norm
    qk_rope_store_kernel[(n,)](
        q, k, v, q_out, k_cache, v_cache, slot_mapping, cos, sin, *weights, eps, num_q_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        q_out.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D=head_dim, HALF=half, NORM=NORM_MODES[norm], PAGE=k_cache.shape[1],
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_F=triton.next_power_of_2(half), BLOCK_R=max(triton.next_power_of_2(head_dim - 2 * half), 1),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4, **launch_args(q.device))
    return q_out
