from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .fused import fused_on_cuda


def normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalise(x) in fp32, cast back before the weight (as HF's Qwen2/Qwen3); x is 2-D."""
    return weight * normalize(x, eps).to(x.dtype)


@fused_on_cuda
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """rms_norm(x + residual) and the sum, which is the next residual."""
    x = x + residual
    return weight * normalize(x, eps).to(x.dtype), x


@fused_on_cuda
def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's norm: the weight is an offset from 1 and scales the fp32 normalised value."""
    return (normalize(x, eps) * (1.0 + weight.float())).to(x.dtype)


@fused_on_cuda
def add_zero_centred_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return (normalize(x, eps) * (1.0 + weight.float())).to(x.dtype), x


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; with `residual` it first adds it, fusing the residual add into the norm."""

    kernels = (rms_norm, add_rms_norm)
    mode = "rms"  # how the fused attention prologue applies it as a q/k norm

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        plain, add = self.kernels
        flat = x.reshape(-1, x.shape[-1])  # per-head q/k norms come as (N, heads, D)
        if residual is None:
            return plain(flat, self.weight, self.eps).view(x.shape)
        out, total = add(flat, residual.reshape(flat.shape), self.weight, self.eps)
        return out.view(x.shape), total.view(x.shape)


@dataclass
class PendingNorm:
    """norm(x + residual), handed unapplied to a module whose first step is a linear layer: at decode sizes on CUDA
    that layer's GEMM applies it in its prologue (`layers.linear`), one launch per norm fewer. Whoever applies it
    sets `total`, the sum, which is the next residual."""
    norm: RMSNorm
    x: torch.Tensor
    residual: torch.Tensor
    total: torch.Tensor | None = None

    def apply(self) -> torch.Tensor:
        out, self.total = self.norm(self.x, self.residual)
        return out

    def input_for(self, module: nn.Module):
        """Itself for modules that take a pending norm (`takes_pending_norm`), else the applied norm."""
        return self if getattr(module, "takes_pending_norm", False) else self.apply()


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm: the weight is stored as an offset from 1, and scales the fp32 normalised value."""

    kernels = (zero_centred_rms_norm, add_zero_centred_rms_norm)
    mode = "zero_centred"

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)


@fused_on_cuda
def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
    """layer_norm(x + residual) and the sum, which is the next residual."""
    x = x + residual
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps), x


class LayerNorm(nn.LayerNorm):
    """The vision towers' LayerNorm with RMSNorm's interface: with `residual` it first adds it, and on CUDA the add
    and the norm are one kernel."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(x)
        return add_layer_norm(x, residual, self.weight, self.bias, self.eps)


ADD_NORMS = {cls.mode: cls.kernels[1] for cls in (RMSNorm, ZeroCenteredRMSNorm)}  # the fused add + norm by mode


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then multiplied by silu(gate) in fp32 (Gated DeltaNet's output norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self.weight * normalize(x, self.eps).to(x.dtype) * F.silu(gate.float())).to(x.dtype)
