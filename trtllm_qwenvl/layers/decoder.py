"""The Qwen decoder stack shared by every family: embeddings, pre-norm blocks, final norm, deepstack adds."""
import torch
from torch import nn

from .forward_context import get_context
from .norm import PendingNorm, RMSNorm
from .rotary import MRotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: token mixer, then MLP. The mixer is full attention (`self_attn`) or, in Qwen3.5's hybrid
    layers, Gated DeltaNet (`linear_attn`); `mixer_name` keeps the checkpoint's name for it."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, norm=RMSNorm,
                 mixer_name: str = "self_attn"):
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm(hidden_size, eps)
        self.post_attention_layernorm = norm(hidden_size, eps)

    def forward(self, x, residual, cos_sin):
        mixer = getattr(self, self.mixer_name)
        if residual is None:
            residual, x = x, mixer(self.input_layernorm(x), cos_sin)
        else:
            pending = PendingNorm(self.input_layernorm, x, residual)
            x = mixer(pending.input_for(mixer), cos_sin)
            residual = pending.total
        pending = PendingNorm(self.post_attention_layernorm, x, residual)
        x = self.mlp(pending.input_for(self.mlp))
        return x, pending.total


class TextModel(nn.Module):
    """forward(positions (3, N), input_ids | inputs_embeds) -> final hidden states (N, hidden)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], eps: float,
                 rotary: MRotaryEmbedding, norm=RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(hidden_size, eps)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary(positions)
        cos_sin = (cos.to(x.dtype), sin.to(x.dtype))
        deepstack = get_context().deepstack
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos_sin)
            if deepstack is not None and i < deepstack.shape[0]:
                # Materialise the block output so the add happens exactly where HF's does.
                x, residual = x + residual + deepstack[i, :x.shape[0]], None
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]
