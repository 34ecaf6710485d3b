"""Qwen3-VL-MoE: Qwen3-VL with sparse MoE MLPs in the decoder (dense where `mlp_only_layers` says so)."""
from ..layers.moe import SparseMoE
from .qwen3_vl import Qwen3VLForCausalLM
from .registry import register


@register("Qwen3VLMoeForConditionalGeneration")
class Qwen3VLMoeForCausalLM(Qwen3VLForCausalLM):
    def __init__(self, hf_config):
        text = hf_config.text_config

        def mlp_for_layer(i):
            sparse = (i not in (text.mlp_only_layers or []) and text.num_experts > 0
                      and (i + 1) % text.decoder_sparse_step == 0)
            if not sparse:
                return None
            return SparseMoE(text.hidden_size, text.moe_intermediate_size, text.num_experts,
                             text.num_experts_per_tok, getattr(text, "norm_topk_prob", True), text.hidden_act)

        super().__init__(hf_config, mlp_for_layer)
