"""Gated DeltaNet: Qwen3.5's linear-attention token mixer, whose per-sequence state lives in the state pool.

Each sequence carries a conv state (the last K-1 inputs of the depthwise causal conv) and a recurrent state
(H, Dk, Dv) in fp32 from chunk to chunk; the model runner binds the pool's tensors and the step says which slot
belongs to which sequence (`ForwardContext.state`). Prefill chunks use the chunked delta rule, single tokens the
recurrent form; on CUDA with flash-linear-attention installed its Triton kernels take their place.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import gated_delta_rule
from .forward_context import StateMetadata, get_context
from .linear import Linear
from .norm import GatedRMSNorm


def delta_rule_kernels(device: torch.device, dtype: torch.dtype):
    """(chunked, recurrent) gated delta rule: fla's Triton kernels on CUDA when importable, else the torch ones.
    fla's chunked kernel refuses fp32 inputs, so fp32 models (parity runs) keep the torch ones."""
    if device.type == "cuda" and dtype != torch.float32:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError:
            pass
    return gated_delta_rule.chunk_gated_delta_rule, gated_delta_rule.recurrent_gated_delta_rule


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        key_dim, value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.conv_kernel = conv_kernel
        self.splits = [self.conv_dim, value_dim, num_v_heads, num_v_heads]  # qkv, z, b, a
        self.in_proj = Linear(hidden_size, sum(self.splits), bias=False)
        starts = [sum(self.splits[:i]) for i in range(4)]
        for p in self.in_proj.parameters():
            p.shards = {name: (start, size) for name, start, size in zip(("qkv", "z", "b", "a"), starts, self.splits)}
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, eps)
        self.out_proj = Linear(value_dim, hidden_size, bias=False)
        self.chunk_rule, self.recurrent_rule = delta_rule_kernels(self.A_log.device, self.A_log.dtype)
        # Bound to views of the engine's state pool by the model runner: (slots, C, K-1) and (slots, H, Dk, Dv).
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)

    def forward(self, x: torch.Tensor, cos_sin=None) -> torch.Tensor:
        meta = get_context().state
        mixed, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if meta.decode:
            out = self.decode(mixed, beta, g, meta.slots)
        else:
            out = torch.cat([self.mix(mixed[lo:hi], beta[lo:hi], g[lo:hi], meta, i)
                             for i, (lo, hi) in enumerate(row_ranges(meta.query_lens))])
        out = self.norm(out.reshape(-1, self.v_head_dim), z.reshape(-1, self.v_head_dim))
        return self.out_proj(out.reshape(x.shape[0], -1))

    def decode(self, mixed, beta, g, slots: torch.Tensor) -> torch.Tensor:
        """One token per sequence, all sequences at once: states gathered and scattered by slot on the device, so
        the step reads no host value and a CUDA graph can capture it."""
        window = torch.cat([self.conv_state[slots], mixed[:, :, None].to(self.conv_state.dtype)], dim=-1)
        y = F.silu((window * self.conv_weight).sum(-1).to(mixed.dtype))
        self.conv_state.index_copy_(0, slots, window[:, :, 1:])
        q, k, v = self.heads(y)
        o, state = self.recurrent_rule(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                       initial_state=self.recurrent_state[slots], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        self.recurrent_state.index_copy_(0, slots, state.float())
        return o[:, 0]

    def mix(self, mixed, beta, g, meta: StateMetadata, i: int) -> torch.Tensor:
        """One sequence's chunk: conv, then the delta rule from its slot's state, saving snapshots on the way."""
        slot, fresh, cuts = meta.slot_list[i], meta.fresh[i], meta.snapshots[i]
        length, width = mixed.shape[0], self.conv_kernel - 1
        y, extended = gated_delta_rule.causal_conv1d(mixed, self.conv_weight, None if fresh else self.conv_state[slot])
        for end, dst in cuts + [(length, slot)]:
            self.conv_state[dst] = extended[:, end:end + width]
        q, k, v = self.heads(y)
        state = None if fresh else self.recurrent_state[slot][None]
        outs, start = [], 0
        for end, dst in cuts + [(length, slot)]:
            if end > start:  # a snapshot at the chunk's end leaves no tokens before the slot's own save
                rule = self.recurrent_rule if end - start == 1 else self.chunk_rule
                # g and beta by keyword: fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta).
                o, state = rule(q[None, start:end], k[None, start:end], v[None, start:end], g=g[None, start:end],
                                beta=beta[None, start:end], initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
                outs.append(o[0])
            self.recurrent_state[dst] = state[0]
            start = end
        return torch.cat(outs)

    def heads(self, y: torch.Tensor):
        """Split the conv output into q, k (repeated up to the value heads) and v."""
        key_dim = self.num_k_heads * self.k_head_dim
        q, k, v = y.split([key_dim, key_dim, y.shape[-1] - 2 * key_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        q = q.reshape(-1, self.num_k_heads, self.k_head_dim).repeat_interleave(repeat, dim=1)
        k = k.reshape(-1, self.num_k_heads, self.k_head_dim).repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(-1, self.num_v_heads, self.v_head_dim)


def row_ranges(lengths: list[int]):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n
