"""Qwen3.5-MoE: Qwen3.5 with a sparse MoE in every decoder layer (softmax top-k, renormalised) plus a shared
expert scaled by sigmoid(shared_expert_gate)."""
from ..layers.moe import SparseMoE
from .qwen3_5 import Qwen3_5ForCausalLM
from .registry import register


@register("Qwen3_5MoeForConditionalGeneration")
class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def __init__(self, hf_config):
        text = hf_config.text_config

        def mlp_for_layer(i):
            return SparseMoE(text.hidden_size, text.moe_intermediate_size, text.num_experts,
                             text.num_experts_per_tok, True, text.hidden_act,
                             shared_intermediate_size=text.shared_expert_intermediate_size)

        super().__init__(hf_config, mlp_for_layer)
