"""Vision-tower rotary, fused for q and k in one launch, in place, for any even head dim (72 and 80 included).

The tiles are padded to powers of two and masked, so head dims that are not a multiple of 64 cost no extra pass.
Like the reference towers, the rotation runs in fp32 and rounds once to the activation dtype.
The torch reference is `layers.rotary.apply_rotary(x.float(), cos, sin).to(x.dtype)` on q and on k.
"""
import torch
import triton
import triton.language as tl

from .mrope import rotate_heads


@triton.jit
def vision_rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                         num_heads, HALF: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_F)
    f_ok = f < HALF
    c = tl.load(cos_ptr + token * stride_cs + f, mask=f_ok, other=1.0)[None, :]
    s = tl.load(sin_ptr + token * stride_cs + f, mask=f_ok, other=0.0)[None, :]
    rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, c, s, f, HALF, BLOCK_H)
    rotate_heads(k_ptr + token * stride_kt, stride_kh, num_heads, c, s, f, HALF, BLOCK_H)


def apply_vision_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (S, H, D) rotated in place and returned; cos, sin (S, D/2) fp32."""
    s, num_heads, _ = q.shape
    half = cos.shape[1]
    if s == 0:
        return q, k
    vision_rotary_kernel[(s,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), num_heads,
        HALF=half, BLOCK_F=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(num_heads), num_warps=4)
    return q, k
