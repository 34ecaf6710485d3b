"""Sparse mixture of experts with a softmax top-k router (Qwen3-MoE family), optionally with Qwen3.5's shared
expert, whose output is scaled by sigmoid(shared_expert_gate(x)) and added to the routed experts'."""
import torch
import torch.nn.functional as F
from torch import nn

from .mlp import ACTIVATIONS, GatedMLP


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                        experts: torch.Tensor, act) -> torch.Tensor:
    """Grouped expert matmuls in torch: tokens sorted by expert, one matmul pair per expert with tokens.

    w13 (E, 2I, H), w2 (E, H, I), weights/experts (T, k). Accumulates experts in ascending order, as HF does.
    """
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # host read: the torch reference only
    tokens = order // top_k
    xs = x[tokens]
    outs = []
    for e, rows in zip(range(w13.shape[0]), xs.split(counts)):
        if rows.shape[0] == 0:
            continue
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, w2[e]))
    ys = torch.cat(outs) * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, ys.to(x.dtype))


class SparseMoE(nn.Module):
    # The torch expert dispatch reads per-expert token counts on the host, which a CUDA graph cannot capture.
    cuda_graph_safe = False

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, act: str = "silu", shared_intermediate_size: int = 0):
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Rows of the stacked weights seen as 2-D, for checkpoints that store each expert separately.
        rows = 2 * intermediate_size
        self.w13.shards = {f"{e}.{part}": (e * rows + i * intermediate_size, intermediate_size)
                           for e in range(num_experts) for i, part in enumerate(("gate", "up"))}
        self.w2.shards = {str(e): (e * hidden_size, hidden_size) for e in range(num_experts)}
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = ACTIVATIONS[act]
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = fused_moe_reference(x, self.w13, self.w2, weights, experts, self.act)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
