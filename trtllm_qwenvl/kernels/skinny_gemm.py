"""Linear layers at decode batch sizes: y = x @ W^T (+ b) for a few rows of x, streaming W once at the HBM rate.

With 1-16 rows the product is a matrix-vector stream: time is W's bytes over the memory bandwidth. Each program
owns BLOCK_N output features over the whole K (no split-K, so no reduction kernel), and W is the MMA's row operand
(swap-AB): the rows of x pad to 16 inside the tile, never in memory. At the Qwen3-VL-8B decoder shapes on an H100
the first version of it measured at most 0.3% slower and up to 8% faster per shape than cuBLAS's choices at 1-8
rows (cuBLAS splits K with a separate reduce for some of them); at 16 rows it lost 9% on gate_up
(perf/results/skinny_gemm_*).

A chain of these kernels (a decode step) also pays each one's ramp: its first weight tiles arrive at HBM latency
after the kernel before it ends. So each program asks L2 for the first PREFETCH_BYTES of its weight rows before
it waits for the kernel ahead (the weights do not depend on it), and lets the next kernel launch only
RELEASE_STEPS K-steps before its own stream ends: released at the start, as other kernels are, the next GEMM's
programs would sit on idle SMs from the beginning and prefetch too early, into lines evicted before use (the
loss grew with the bytes prefetched). At the Qwen3-VL-8B decoder shapes on an H100 this took a decode step at
batch 1 from 6.02 to 5.94 ms (perf/results/experiments_h100_2026-11-25_ef441fe.md).

The torch reference is `torch.nn.functional.linear`.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import launch_args, release, wait
from .qk_rope_store import NORM_MODES  # the same codes as the attention prologue's q/k norms

MAX_ROWS = 16  # one MMA column tile of x; larger batches go to cuBLAS, which tiles them well
PREFETCH_BYTES = 1024  # of each weight row, before the wait: the first two 256-column steps
RELEASE_STEPS = 4  # K-steps before the end at which the next kernel may launch


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def fold_norm(x, squares, r_ptr, g_ptr, sum_ptr, k0, k, m, x_mask, stride_rm, stride_sm, K, NORM: tl.constexpr):
    """One (BLOCK_K, BLOCK_M) chunk of x -> g * (x + r) for the product, and the sum's squares added to `squares`.
    The sum is rounded to the activations' dtype first, as the residual stream is; program 0 stores it."""
    dtype = x.dtype
    s = (x.to(tl.float32) + tl.load(r_ptr + m[None, :] * stride_rm + (k0 + k)[:, None], mask=x_mask,
                                     other=0.0).to(tl.float32)).to(dtype)
    if tl.program_id(0) == 0:
        tl.store(sum_ptr + m[None, :] * stride_sm + (k0 + k)[:, None], s, mask=x_mask)
    s = s.to(tl.float32)
    g = tl.load(g_ptr + k0 + k, mask=k0 + k < K, other=0.0).to(tl.float32)[:, None]
    scaled = s * (1.0 + g) if NORM == 2 else s * g
    return scaled.to(dtype), squares + tl.sum(s * s, 0)


@triton.jit
def prefetch_rows(w_ptr, w_row, stride_wn, PREFETCH: tl.constexpr):
    """Ask L2 for the first PREFETCH bytes of each weight row `w_row`: one bulk prefetch a row, holding no registers
    or shared memory while the data arrives."""
    addr = (w_ptr + w_row.to(tl.int64) * stride_wn).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addr, tl.full(w_row.shape, PREFETCH, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, g_ptr, sum_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       stride_rm, stride_sm, eps, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       SILU_MUL: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                       RELEASE_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """y = x @ W^T (+ b), or with SILU_MUL (W = [gate; up], N = 2 * out features) y = silu(x @ gate^T) * (x @ up^T):
    each program then streams BLOCK_N // 2 gate rows and the matching up rows as one tile, so both halves of an
    output feature meet in its registers after a single MMA per step (two MMAs sharing x, one per half, ran 2.3x
    slower once x also fed the norm's sum of squares).

    NORM (1: RMSNorm, 2: zero-centred RMSNorm) takes x as the RMS-normalised sum s = x + r with norm weight g, and
    program 0 writes s to sum_ptr. A row's 1/rms is one scalar, so it factors out of the product:
    y = rstd * (W @ (g * s)), with the sum of squares gathered in the same pass over K."""
    ROWS: tl.constexpr = BLOCK_N // 2 if SILU_MUL else BLOCK_N  # output features per program
    n_out = N // 2 if SILU_MUL else N
    tile = tl.arange(0, BLOCK_N)
    feature = tl.program_id(0) * ROWS + tile % ROWS
    w_row = feature + (tile // ROWS) * n_out if SILU_MUL else feature
    w_ok = feature < n_out
    if PREFETCH:
        prefetch_rows(w_ptr, tl.where(w_ok, w_row, 0), stride_wn, PREFETCH)
    wait(PDL)
    k_release = tl.maximum(K - RELEASE_STEPS * BLOCK_K, 0) // BLOCK_K * BLOCK_K
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    m_ok = m < M
    w_ptrs = w_ptr + w_row.to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptrs = x_ptr + m[None, :] * stride_xm + k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_mask = w_ok[:, None]
        x_mask = m_ok[None, :]
        if not EVEN_K:
            w_mask = w_mask & (k0 + k < K)[None, :]
            x_mask = x_mask & (k0 + k < K)[:, None]
        if k0 == k_release:
            release(PDL)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if NORM:
            x, squares = fold_norm(x, squares, r_ptr, g_ptr, sum_ptr, k0, k, m, x_mask, stride_rm, stride_sm, K,
                                   NORM)
        acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if NORM:
        acc *= tl.rsqrt(squares / K + eps)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_row, mask=w_ok, other=0.0).to(tl.float32)[:, None]
    dtype = y_ptr.dtype.element_ty
    if SILU_MUL:  # rounded as the torch path rounds: the projection to dtype, then the activation once
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, ROWS, BLOCK_M)), (1, 2, 0)))
        gate = gate.to(dtype).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up.to(dtype).to(tl.float32)
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(y_ptrs, acc.to(dtype), mask=(n < n_out)[:, None] & m_ok[None, :])


# The most frequent best of a 54-config sweep on an H100 over the decoder shapes of Qwen3-VL-8B and Qwen2.5-VL-7B at
# 1-16 rows (perf/bench_skinny_gemm.py --sweep: best on 19 of 36 rows). Fewer, wider programs beat more, narrower
# ones: the first version, which shrank the feature block until every SM had two programs, was slower.
DEFAULT = Config(block_n=64, block_k=256, num_warps=4, num_stages=4)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: Config | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x (M <= 16, K) with unit stride along K; weight (N, K) contiguous rows; bias (N,) or None -> (M, N).
    silu_mul: weight is a gate_up projection [gate; up] and the result silu(gate) * up, (M, N // 2): the MLP's
    activation in the GEMM's epilogue, one launch per layer fewer."""
    return launch(x, weight, bias, config, silu_mul, None)[0]


def skinny_gemm_normed(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, mode: str,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, config: Config | None = None,
                       silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`skinny_gemm` of norm(x + residual) (`mode` as layers.norm's RMSNorm.mode), and the sum x + residual: the
    pre-norm block's residual add and RMSNorm in the GEMM's prologue, one launch per norm fewer."""
    assert residual.shape == x.shape and residual.stride(1) == 1 and norm_weight.shape == (x.shape[1],)
    return launch(x, weight, bias, config, silu_mul, (residual, norm_weight, eps, NORM_MODES[mode]))


def prefetch_bytes(weight: torch.Tensor, pdl: bool) -> int:
    """PREFETCH_BYTES within a row, in whole 16-byte units from 16-byte aligned rows, as the bulk prefetch needs;
    none without PDL, where no kernel runs ahead of this one's wait."""
    size = weight.element_size()
    aligned = weight.data_ptr() % 16 == 0 and weight.stride(0) * size % 16 == 0
    if not (aligned and pdl):
        return 0
    return min(PREFETCH_BYTES, weight.shape[1] * size) // 16 * 16


def launch(x, weight, bias, config, silu_mul, norm) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1 and not (silu_mul and n % 2)
    y = torch.empty(m, n // 2 if silu_mul else n, device=x.device, dtype=x.dtype)
    total = torch.empty_like(x, memory_format=torch.contiguous_format) if norm else None
    if m == 0:
        return y, total
    residual, norm_weight, eps, mode = norm or (x, x, 0.0, NORM_MODES["none"])
    cfg = config or DEFAULT
    pdl = launch_args(x.device)
    skinny_gemm_kernel[(triton.cdiv(y.shape[1], cfg.block_n // 2 if silu_mul else cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, residual, norm_weight, total if norm else x, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), residual.stride(0), k, eps, HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, SILU_MUL=silu_mul, NORM=mode, PREFETCH=prefetch_bytes(weight, pdl["PDL"]),
        RELEASE_STEPS=RELEASE_STEPS, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    return y, total
