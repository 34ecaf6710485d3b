"""The LM's linear layer: decode-sized inputs on CUDA go to the skinny GEMM kernel, everything else to cuBLAS.
`Linear.silu_mul` is the MLP's gate_up projection with its silu(gate) * up folded in: at decode sizes the skinny
kernel applies the activation in its epilogue, one launch per layer fewer; larger CUDA inputs take the vectorised
`kernels.silu_mul` after cuBLAS.

The choice depends on the row count, which is symbolic inside the compiled LM body; a Python branch there would
make dynamo guard on it and compile the body twice. So the compiled body calls one opaque custom op that chooses
at run time (each CUDA graph records the choice for its size), while eager code chooses directly and skips the
op's dispatch cost.

A pre-norm block hands its RMSNorm to the next linear layer unapplied (`layers.norm.PendingNorm`); decode-sized
rows then get the residual add and the norm in the skinny GEMM's prologue, one launch per norm fewer, through the
same kind of op in the compiled body.
"""
import torch
import torch.nn.functional as F
from torch import nn

from .norm import ADD_NORMS, PendingNorm


SKINNY_MAX_ROWS = 16  # kernels.skinny_gemm.MAX_ROWS, not imported here: Triton is GPU-only


def use_skinny(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16))


def normed_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, mode: str,
                  weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear` of norm(x + residual) (`mode` as RMSNorm.mode), and the sum; decode-sized CUDA rows in one skinny
    GEMM that applies the norm in its prologue."""
    if use_skinny(x):
        from ..kernels.skinny_gemm import skinny_gemm_normed
        return skinny_gemm_normed(x, residual, norm_weight, eps, mode, weight, bias, silu_mul=silu_mul)
    out, total = ADD_NORMS[mode](x, residual, norm_weight, eps)
    return linear(out, weight, bias, silu_mul), total


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias); with silu_mul, weight is a gate_up projection and the result silu(gate) * up."""
    if use_skinny(x):
        from ..kernels.skinny_gemm import skinny_gemm  # Triton: imported only where a GPU runs it
        return skinny_gemm(x, weight, bias, silu_mul=silu_mul)
    y = F.linear(x, weight, bias)
    if not silu_mul:
        return y
    if y.is_cuda:
        from ..kernels.silu_mul import silu_mul as silu_mul_kernel
        return silu_mul_kernel(y.view(-1, y.shape[-1])).view(*y.shape[:-1], -1)
    return silu_and_mul(y)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gate_up projection's output [gate, up]: the CPU path and the kernel's reference."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.library.custom_op("trtllm_qwenvl::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    return linear(x, weight, bias, silu_mul)


@linear_op.register_fake
def _(x, weight, bias, silu_mul):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2 if silu_mul else weight.shape[0])


@torch.library.custom_op("trtllm_qwenvl::normed_linear", mutates_args=())
def normed_linear_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, mode: str,
                     weight: torch.Tensor, bias: torch.Tensor | None,
                     silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return normed_linear(x, residual, norm_weight, eps, mode, weight, bias, silu_mul)


@normed_linear_op.register_fake
def _(x, residual, norm_weight, eps, mode, weight, bias, silu_mul):
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if silu_mul else weight.shape[0]), x.new_empty(x.shape)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, False)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output [gate, up] (a gate_up projection)."""
        return self.project(x, True)

    def project(self, x: torch.Tensor | PendingNorm, silu_mul: bool) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            norm = x.norm
            args = (x.x, x.residual, norm.weight, norm.eps, norm.mode, self.weight, self.bias, silu_mul)
            y, x.total = normed_linear_op(*args) if torch.compiler.is_compiling() else normed_linear(*args)
            return y
        if torch.compiler.is_compiling():
            return linear_op(x, self.weight, self.bias, silu_mul)
        return linear(x, self.weight, self.bias, silu_mul)
