"""Norms that take the residual add into their kernel: a pre-norm block's RMSNorm handed unapplied to the next module
(layers.norm.PendingNorm) and the vision towers' LayerNorm, against float64."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trtllm_qwenvl.layers.linear import Linear
from trtllm_qwenvl.layers.mlp import GatedMLP
from trtllm_qwenvl.layers.norm import LayerNorm, PendingNorm, RMSNorm, ZeroCenteredRMSNorm

NORMS = [RMSNorm, ZeroCenteredRMSNorm]


def normed64(x, residual, norm):
    s = (x + residual).double()
    scaled = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps)
    weight = norm.weight.double()
    return scaled * (1 + weight if isinstance(norm, ZeroCenteredRMSNorm) else weight)


def pending(norm_cls, rows=5, hidden=64):
    torch.manual_seed(0)
    norm = norm_cls(hidden, eps=1e-6)
    nn.init.normal_(norm.weight, std=0.5)
    return PendingNorm(norm, torch.randn(rows, hidden), torch.randn(rows, hidden))


@pytest.mark.parametrize("norm_cls", NORMS)
def test_linear_applies_pending_norm_and_sets_the_sum(norm_cls):
    p = pending(norm_cls)
    linear = Linear(64, 48, bias=True)
    y = linear(p)
    want = F.linear(normed64(p.x, p.residual, p.norm), linear.weight.double(), linear.bias.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(p.total, p.x + p.residual)


@pytest.mark.parametrize("norm_cls", NORMS)
def test_gated_mlp_applies_pending_norm(norm_cls):
    p = pending(norm_cls)
    mlp = GatedMLP(64, 32)
    gate, up = F.linear(normed64(p.x, p.residual, p.norm), mlp.gate_up_proj.weight.double()).chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, mlp.down_proj.weight.double())
    torch.testing.assert_close(mlp(p).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(p.total, p.x + p.residual)


def test_modules_without_the_flag_get_the_applied_norm():
    p = pending(RMSNorm)
    out = p.input_for(nn.Identity())
    torch.testing.assert_close(out.double(), normed64(p.x, p.residual, p.norm), rtol=1e-5, atol=1e-5)
    assert torch.equal(p.total, p.x + p.residual)
    assert p.input_for(GatedMLP(64, 32)) is p


def test_layer_norm_adds_the_residual_first():
    """The vision towers' LayerNorm with a residual: layer_norm(x + residual) and the sum, against float64."""
    torch.manual_seed(0)
    norm = LayerNorm(64, eps=1e-6)
    nn.init.normal_(norm.weight, std=0.5)
    nn.init.normal_(norm.bias, std=0.5)
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    out, total = norm(x, residual)
    s = (x + residual).double()
    want = (s - s.mean(-1, keepdim=True)) / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + norm.eps)
    torch.testing.assert_close(out.double(), want * norm.weight.double() + norm.bias.double(), rtol=1e-5, atol=1e-5)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(norm(x).double(), F.layer_norm(x.double(), (64,), norm.weight.double(),
                                                               norm.bias.double(), norm.eps), rtol=1e-5, atol=1e-5)
