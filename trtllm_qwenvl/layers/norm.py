import torch
import torch.nn.functional as F
from torch import nn

from .fused import fused_on_cuda


@fused_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """weight * normalise(x [+ residual]) in fp32, cast back before the weight (as HF's Qwen2/Qwen3); with a
    residual, also returns the sum, which is the next residual."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


@fused_on_cuda
def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Qwen3.5's norm: the weight is an offset from 1 and scales the fp32 normalised value."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, x)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; with `residual` it first adds it, fusing the residual add into the norm."""

    kernel = staticmethod(rms_norm)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernel(x, self.weight, self.eps, residual)


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm: the weight is stored as an offset from 1, and scales the fp32 normalised value."""

    kernel = staticmethod(zero_centred_rms_norm)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then multiplied by silu(gate) in fp32 (Gated DeltaNet's output norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)
