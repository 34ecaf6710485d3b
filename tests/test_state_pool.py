"""The linear-attention state pool and its prefix snapshots: LRU bookkeeping and the memory per slot. End-to-end
hybrid behaviour (chunked prefill, preemption, snapshot prefix hits) is in test_parity.py."""
import torch
import transformers

from trtllm_qwenvl.engine.state_pool import StatePool, bytes_per_slot
from trtllm_qwenvl.engine.state_snapshots import StateSnapshots
from trtllm_qwenvl.layers.gated_deltanet import GatedDeltaNet


def test_snapshots_are_an_lru_published_after_the_step():
    snaps = StateSnapshots(range(10, 12))
    a, b = snaps.reserve(1), snaps.reserve(2)
    assert {a, b} == {10, 11} and snaps.reserve(1) is None  # already being written
    assert snaps.lookup(1) is None  # not visible before its step commits
    snaps.publish(1)
    snaps.publish(2)
    assert snaps.lookup(1) == a  # 1 is now the most recently used
    assert snaps.reserve(3) == b  # full: evicts 2, the least recently used
    assert snaps.lookup(2) is None
    snaps.drop(3)  # its step failed: the slot is free again, the key unknown
    assert snaps.lookup(3) is None and snaps.reserve(4) == b


def layers_of(text, device="cpu"):
    with torch.device(device):
        return [GatedDeltaNet(text.hidden_size, text.linear_num_key_heads, text.linear_num_value_heads,
                              text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim,
                              text.rms_norm_eps)
                for kind in text.layer_types if kind == "linear_attention"]


def test_slot_bytes():
    text = transformers.Qwen3_5TextConfig()  # Qwen3.5-9B-like shapes: 24 of 32 layers linear
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + \
        text.linear_num_value_heads * text.linear_value_head_dim
    per_layer = conv_dim * (text.linear_conv_kernel_dim - 1) * 2 + \
        text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    assert bytes_per_slot(layers_of(text, "meta"), torch.bfloat16) == 24 * per_layer == 51_511_296
    small = transformers.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32)
    pool = StatePool(layers_of(small), 2, 1, "cpu", torch.float32)
    assert pool.slot_bytes == (pool.conv[:, 0].nbytes + pool.recurrent[:, 0].nbytes)


def test_hybrid_without_snapshots_serves_without_reuse(checkpoints):
    """No snapshot slots means no hybrid prefix can be restored: block reuse turns off instead of half-working."""
    from trtllm_qwenvl import LLM, SamplingParams
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(checkpoints("qwen3_5"), dtype="float32",
             kv_cache_config={"tokens_per_block": 16, "max_state_snapshots": 0}) as llm:
        first, second = llm.generate(["The same prompt, twice over. " * 4] * 2, params, use_tqdm=False)
        blocks = llm.engine.blocks
        all_free = blocks.num_free_blocks == blocks.num_blocks
    assert not blocks.enable_reuse and all_free
    assert second.num_cached_tokens == 0 and first.outputs[0].token_ids == second.outputs[0].token_ids
