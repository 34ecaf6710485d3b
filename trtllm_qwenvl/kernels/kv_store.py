"""KV-cache store: each of the step's tokens writes its K and V rows into the paged cache at its slot.

One launch stores both K and V. A negative slot means "no cache row" (padding tokens of a captured graph) and is
skipped. The torch reference is the `index_copy_` pair in `layers.attention_backends.TorchPagedAttention.forward`.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_block, stride_pos, stride_head,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    i = tl.arange(0, BLOCK)
    mask = i < ROW
    head, d = i // HEAD_DIM, i % HEAD_DIM
    dst = (slot // PAGE) * stride_block + (slot % PAGE) * stride_pos + head * stride_head + d
    t = token.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v (N, kv_heads, head_dim), any token/head strides; caches (num_blocks, block_size, kv_heads, head_dim)."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    row = kv_heads * head_dim
    store_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK=triton.next_power_of_2(row), ROW=row, num_warps=4)
