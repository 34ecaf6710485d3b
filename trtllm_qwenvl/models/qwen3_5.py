"""Qwen3.5: Qwen3-VL's vision tower without deepstack, on a hybrid decoder. `text_config.layer_types` makes each
layer Gated DeltaNet (linear attention, state in the state pool) or gated full attention (paged KV) with partial
interleaved mRoPE; every RMSNorm of the decoder is zero-centred (1 + w)."""
from ..layers.attention import Attention
from ..layers.decoder import DecoderLayer, TextModel
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.mlp import GatedMLP
from ..layers.norm import ZeroCenteredRMSNorm
from ..layers.rotary import MRotaryEmbedding
from .base import VLForCausalLM
from .qwen3_vl import Qwen3VisionTower, Qwen3VLForCausalLM
from .registry import register


def build_hybrid_text_model(text, mlp_for_layer) -> TextModel:
    rope = text.rope_parameters
    rotary = MRotaryEmbedding(int(text.head_dim * rope.get("partial_rotary_factor", 1.0)),
                              text.max_position_embeddings, rope["rope_theta"], rope["mrope_section"], True)

    def mixer(i):
        if text.layer_types[i] == "linear_attention":
            return GatedDeltaNet(text.hidden_size, text.linear_num_key_heads, text.linear_num_value_heads,
                                 text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim,
                                 text.rms_norm_eps), "linear_attn"
        return Attention(text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
                         text.attention_bias, qk_norm_eps=text.rms_norm_eps, gated=True,
                         norm=ZeroCenteredRMSNorm), "self_attn"

    def layer(i):
        module, name = mixer(i)
        return DecoderLayer(module, mlp_for_layer(i), text.hidden_size, text.rms_norm_eps, ZeroCenteredRMSNorm, name)

    return TextModel(text.vocab_size, text.hidden_size, [layer(i) for i in range(text.num_hidden_layers)],
                     text.rms_norm_eps, rotary, ZeroCenteredRMSNorm)


@register("Qwen3_5ForConditionalGeneration")
class Qwen3_5ForCausalLM(VLForCausalLM):
    vision_rules = Qwen3VLForCausalLM.vision_rules
    skip_weights = (r"^mtp\.",)  # the multi-token-prediction head: speculative decoding, not served here

    def __init__(self, hf_config, mlp_for_layer=None):
        text = hf_config.text_config
        mlp_for_layer = mlp_for_layer or (lambda i: GatedMLP(text.hidden_size, text.intermediate_size,
                                                             text.hidden_act))
        super().__init__(hf_config, Qwen3VisionTower(hf_config.vision_config),
                         build_hybrid_text_model(text, mlp_for_layer))
