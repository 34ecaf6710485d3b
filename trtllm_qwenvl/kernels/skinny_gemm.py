"""Linear layers at decode batch sizes: y = x @ W^T (+ b) for a few rows of x, streaming W once at the HBM rate.

With 1-16 rows the product is a matrix-vector stream: time is W's bytes over the memory bandwidth. Each program
owns BLOCK_N output features over the whole K (no split-K, so no reduction kernel), and W is the MMA's row operand
(swap-AB): the rows of x pad to 16 inside the tile, never in memory. At the Qwen3-VL-8B decoder shapes on an H100
the first version of it measured at most 0.3% slower and up to 8% faster per shape than cuBLAS's choices at 1-8
rows (cuBLAS splits K with a separate reduce for some of them); at 16 rows it lost 9% on gate_up
(perf/results/skinny_gemm_*).

The torch reference is `torch.nn.functional.linear`.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # one MMA column tile of x; larger batches go to cuBLAS, which tiles them well


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    m_ok = m < M
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + m[None, :] * stride_xm + k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k < K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# The most frequent best of a 54-config sweep on an H100 over the decoder shapes of Qwen3-VL-8B and Qwen2.5-VL-7B at
# 1-16 rows (perf/bench_skinny_gemm.py --sweep: best on 19 of 36 rows). Fewer, wider programs beat more, narrower
# ones: the first version, which shrank the feature block until every SM had two programs, was slower.
DEFAULT = Config(block_n=64, block_k=256, num_warps=4, num_stages=4)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: Config | None = None) -> torch.Tensor:
    """x (M <= 16, K) with unit stride along K; weight (N, K) contiguous rows; bias (N,) or None -> (M, N)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    cfg = config or DEFAULT
    skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
