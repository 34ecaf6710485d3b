"""LM self-attention. The paged attention call is one registered custom op: the split point for piecewise graphs."""
import torch
from torch import nn

from .attention_backends import Prologue, active_backend
from .forward_context import get_context
from .linear import Linear
from .norm import RMSNorm


@torch.library.custom_op("trtllm_qwenvl::paged_attention", mutates_args=("k_cache", "v_cache", "out"))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, norm_eps: float, norm: str,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """q, k, v straight from the qkv projection: the backend applies the q/k norm (`norm`: "none", "rms",
    "zero_centred") and the rotary, stores K/V, and attends into `out`."""
    meta = get_context().attn
    backend = active_backend()
    if not meta.plan:
        meta.plan = backend.plan(meta)
    prologue = Prologue(cos, sin, q_norm, k_norm, norm_eps, norm)
    backend.forward(q, k, v, prologue, k_cache, v_cache, out, scale, meta)


@paged_attention.register_fake
def _(q, k, v, cos, sin, q_norm, k_norm, norm_eps, norm, k_cache, v_cache, out, scale) -> None:
    return None


class Attention(nn.Module):
    """GQA attention with fused qkv, optional per-head q/k RMSNorm and rotary from shared cos/sin.

    `gated` (Qwen3.5): q_proj emits each head's query followed by a gate of the same size, and the attention output
    is scaled by sigmoid(gate) before o_proj. `norm` is the q/k norm class.
    """

    takes_pending_norm = True  # x may be a layers.norm.PendingNorm: qkv_proj applies it

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool,
                 qk_norm_eps: float | None = None, gated: bool = False, norm=RMSNorm):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gated = gated
        q_rows, kv_rows = num_heads * head_dim * (2 if gated else 1), num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, q_rows + 2 * kv_rows, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = norm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = norm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.scale = head_dim ** -0.5
        self.splits = [q_rows, kv_rows, kv_rows]
        shards = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
        for p in self.qkv_proj.parameters():
            p.shards = shards  # lets the loader fill q/k/v checkpoint tensors into the fused matrix
        # Bound to views of the engine's KV pool by the model runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n = qkv.shape[0]
        q, k, v = qkv.split(self.splits, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = q.new_empty(n, self.num_heads, self.head_dim)
        qn, kn = self.q_norm, self.k_norm
        if qn is None:
            norm = (None, None, 0.0, "none")
        else:
            norm = (qn.weight, kn.weight, qn.eps, qn.mode)
        paged_attention(q, k, v, *cos_sin, *norm, self.k_cache, self.v_cache, out, self.scale)
        out = out.view(n, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(out)
