import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * (1.702 * x).sigmoid(),
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    takes_pending_norm = True  # x may be a layers.norm.PendingNorm: gate_up_proj applies it

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[act]
        for p in self.gate_up_proj.parameters():
            p.shards = {"gate": (0, intermediate_size), "up": (intermediate_size, intermediate_size)}

    def forward(self, x):
        if self.act is F.silu:
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MLP(nn.Module):
    """fc2(act(fc1(x))): the vision towers' plain MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = True):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.linear_fc2 = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[act]
        self.gelu_epilogue = act == "gelu_pytorch_tanh" and bias

    def forward(self, x):
        return self.linear_fc2(self.fc1_act(x))

    def fc1_act(self, x):
        # cuBLASLt applies the bias and tanh-GELU in the GEMM's epilogue, in fp32 before the one rounding to the
        # activation dtype: no separate GELU kernel reading and writing the widest activation of the block.
        if self.gelu_epilogue and x.is_cuda and x.dim() == 2:
            return torch._addmm_activation(self.linear_fc1.bias, x, self.linear_fc1.weight.t(), use_gelu=True)
        return self.act(self.linear_fc1(x))
