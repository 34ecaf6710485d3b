"""The gated delta rule and the causal depthwise conv in torch: the CPU reference for Gated DeltaNet layers.

Shapes follow flash-linear-attention's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` (q, k
(B, T, H, Dk), v (B, T, H, Dv), g and beta (B, T, H), state (B, H, Dk, Dv)), so those GPU kernels drop in
unchanged. Per token, with the state decayed by exp(g) first:
    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q / sqrt(Dk)
"""
import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q, k, v, g, beta, normalize_qk: bool):
    """fp32, heads before time, q/k optionally L2-normalised, q scaled by 1/sqrt(Dk)."""
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def initial(state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if state is None:
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    return state.float()


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False):
    """Token by token (decode). Returns the output (B, T, H, Dv) in v's dtype and, if asked, the final fp32
    state."""
    dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    state = initial(initial_state, q, v)
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        k_t = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., None] * delta[..., None, :]
        out[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], state)
    return out.transpose(1, 2).to(dtype), state if output_final_state else None


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, chunk_size=64):
    """Chunkwise (prefill): inside a chunk the delta updates form a unit lower-triangular system, solved once;
    only the state hand-off between chunks is sequential. Same result as the recurrent form."""
    dtype = v.dtype
    q, k, v, g, beta = prepare(q, k, v, g, beta, use_qk_l2norm_in_kernel)
    state = initial(initial_state, q, v)
    length = q.shape[2]
    pad = -length % chunk_size
    # Padded steps have g = 0 and beta = 0: no decay and no update, so they leave the state alone.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    b, h, n = q.shape[0], q.shape[1], q.shape[2] // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, -1) for x in (q, k, v))
    beta = beta.reshape(b, h, n, chunk_size, 1)
    decay = g.reshape(b, h, n, chunk_size).cumsum(-1)  # log decay from the chunk start to each step
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # Step i's write u_i depends on the earlier writes of its chunk through beta_i * decay_ij * (k_i . k_j).
    system = (beta * (k @ k.transpose(-1, -2)) * pair_decay).tril(-1)
    system = system + torch.eye(chunk_size, device=q.device)
    rhs = torch.cat([beta * v, beta * decay.exp()[..., None] * k], -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes, state_reads = solved.split([v.shape[-1], k.shape[-1]], -1)  # u = writes - state_reads @ S
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(n):
        u = writes[:, :, c] - state_reads[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * chunk_size, -1)[:, :, :length]
    return out.transpose(1, 2).to(dtype), state if output_final_state else None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's chunk.

    x (T, C) continues `state` (C, K-1), the inputs before the chunk (None: zeros). Returns the output (T, C) and
    the extended input (C, K-1+T), whose last K-1 columns are the next state.
    """
    width = weight.shape[1]
    if state is None:
        state = x.new_zeros(x.shape[1], width - 1)
    extended = torch.cat([state.to(x.dtype), x.t()], dim=1)
    out = F.conv1d(extended[None], weight[:, None, :], groups=x.shape[1])[0]
    return F.silu(out).t(), extended
