"""The shape every family shares: vision tower + decoder LM + LM head, and what the runtime calls on it."""
from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer, TextModel
from ..layers.linear import Linear
from ..layers.mlp import GatedMLP
from ..layers.rotary import MRotaryEmbedding
from .weights import LM_RULES, Rule, load_weights, randomize_weights


@dataclass
class VisionOutput:
    embeds: torch.Tensor                 # (M, hidden): one row per LM placeholder token, items in order
    deepstack: torch.Tensor | None = None  # (levels, M, hidden) for Qwen3-VL


class VLForCausalLM(nn.Module):
    """Families subclass this, build `visual` and `language_model`, and list their weight rules."""

    vision_rules: list[Rule] = []
    skip_weights: tuple[str, ...] = ()

    def __init__(self, hf_config, visual: nn.Module | None, language_model: TextModel):
        super().__init__()
        text = hf_config.text_config
        self.hf_config = hf_config
        self.visual = visual
        self.language_model = language_model
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)
        # The HF config class already folds legacy text_config ties into the top-level flag.
        self.tie_word_embeddings = bool(hf_config.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.lm_head.weight = language_model.embed_tokens.weight
        self.num_deepstack_levels = 0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def encode(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> VisionOutput:
        return self.visual(pixel_values, grids)

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model(positions, input_ids=input_ids, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load(self, model_dir, load_format: str = "auto") -> None:
        if load_format == "dummy":
            randomize_weights(self)
            return
        tied = {"lm_head.weight": "language_model.embed_tokens.weight"} if self.tie_word_embeddings else None
        load_weights(self, model_dir, self.vision_rules + LM_RULES, skip=self.skip_weights, tied=tied)


def build_text_model(text, *, qk_norm: bool, interleaved: bool, mlp_for_layer=None) -> TextModel:
    """The Qwen2/Qwen3 decoder from an HF text config; `mlp_for_layer(i)` overrides the dense MLP (MoE)."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = text.rope_parameters
    rotary = MRotaryEmbedding(head_dim, text.max_position_embeddings, rope["rope_theta"], rope["mrope_section"],
                              interleaved)
    qkv_bias = getattr(text, "attention_bias", True)

    def layer(i):
        attn = Attention(text.hidden_size, text.num_attention_heads, text.num_key_value_heads, head_dim, qkv_bias,
                         qk_norm_eps=text.rms_norm_eps if qk_norm else None)
        mlp = (mlp_for_layer(i) if mlp_for_layer else None) or GatedMLP(
            text.hidden_size, text.intermediate_size, text.hidden_act)
        return DecoderLayer(attn, mlp, text.hidden_size, text.rms_norm_eps)

    return TextModel(text.vocab_size, text.hidden_size, [layer(i) for i in range(text.num_hidden_layers)],
                     text.rms_norm_eps, rotary)
