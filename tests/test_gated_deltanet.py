"""Gated DeltaNet against HF transformers' torch implementation: the delta-rule kernels, the conv, and the layer
run in chunks through state-pool slots (state carried across chunks, restored from a prefix snapshot)."""
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from trtllm_qwenvl.engine.state_pool import StatePool
from trtllm_qwenvl.layers import gated_delta_rule as rule
from trtllm_qwenvl.layers.forward_context import ForwardContext, StateMetadata, reset_context, set_context
from trtllm_qwenvl.layers.gated_deltanet import GatedDeltaNet
from trtllm_qwenvl.models import tiny

from conftest import relative_error


def inputs(seed=0, batch=2, length=150, heads=4, dk=16, dv=32):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(batch, length, heads, dk, generator=g), torch.randn(batch, length, heads, dk, generator=g)
    v = torch.randn(batch, length, heads, dv, generator=g)
    decay = -0.3 * torch.rand(batch, length, heads, generator=g)
    beta = torch.rand(batch, length, heads, generator=g)
    state = 0.1 * torch.randn(batch, heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length", [1, 37, 150])
def test_chunked_rule_matches_hf(length):
    q, k, v, g, beta, state = inputs(length=length)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours, ours_state = rule.chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert relative_error(ours, ref) <= 1e-5 and relative_error(ours_state, ref_state) <= 1e-5


def test_recurrent_rule_matches_hf():
    q, k, v, g, beta, state = inputs(length=5)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours, ours_state = rule.recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    assert relative_error(ours, ref) <= 1e-6 and relative_error(ours_state, ref_state) <= 1e-6


def test_conv_continues_across_chunks():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(30, 12, generator=g), torch.randn(12, 4, generator=g)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    first, extended = rule.causal_conv1d(x[:11], weight, None)
    second, _ = rule.causal_conv1d(x[11:], weight, extended[:, -3:])
    assert relative_error(torch.cat([first, second]), ref) <= 1e-6


@pytest.fixture(scope="module")
def layers():
    """HF's layer with every parameter randomised, and ours holding the same weights."""
    text = tiny.build_config("qwen3_5").text_config
    torch.manual_seed(0)
    theirs = hf.Qwen3_5GatedDeltaNet(text, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_({"A_log": -3 + 0.5 * torch.randn(p.shape)}.get(name, 0.3 * torch.randn(p.shape)))
        theirs.norm.weight.add_(1)
    ours = GatedDeltaNet(text.hidden_size, text.linear_num_key_heads, text.linear_num_value_heads,
                         text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim,
                         text.rms_norm_eps)
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([theirs.in_proj_qkv.weight, theirs.in_proj_z.weight,
                                             theirs.in_proj_b.weight, theirs.in_proj_a.weight]))
        ours.conv_weight.copy_(theirs.conv1d.weight[:, 0])
        for name in ("dt_bias", "A_log", "norm.weight", "out_proj.weight"):
            ours.get_parameter(name).copy_(theirs.get_parameter(name))
    return theirs, ours


def run(layer, x, chunks):
    """Feed `chunks` [(rows, slot, fresh, snapshots)] of x through `layer` as one step each."""
    outs = []
    for rows, slot, fresh, cuts in chunks:
        set_context(ForwardContext(state=StateMetadata(torch.tensor([slot]), [rows.stop - rows.start], [slot], [fresh], [cuts])))
        try:
            outs.append(layer(x[rows]))
        finally:
            reset_context()
    return torch.cat(outs)


def test_layer_in_chunks_matches_hf_and_snapshot_restores(layers):
    theirs, ours = layers
    pool = StatePool([ours], num_seq_slots=2, num_snapshots=1, device="cpu", dtype=torch.float32)
    x = 0.5 * torch.randn(40, theirs.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(x[None])[0]
        # A prefill cut at 17 tokens, one single-token (recurrent) step, then the rest with a snapshot at token 28.
        out = run(ours, x, [(slice(0, 17), 0, True, []), (slice(17, 18), 0, False, []),
                            (slice(18, 40), 0, False, [(10, 2)])])
        assert relative_error(out, ref) <= 1e-5
        # A second sequence restored from the snapshot continues exactly where the first one was at token 28.
        pool.copy(2, 1)
        resumed = run(ours, x, [(slice(28, 40), 1, False, [])])
    assert relative_error(resumed, ref[28:]) <= 1e-5


def test_snapshot_at_the_chunk_end(layers):
    """A chunk ending exactly on a snapshot point (chunked prefill cut at a block boundary) runs no empty segment
    and saves the same state into the snapshot and the sequence's slot."""
    theirs, ours = layers
    pool = StatePool([ours], num_seq_slots=1, num_snapshots=1, device="cpu", dtype=torch.float32)
    x = 0.5 * torch.randn(40, theirs.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = theirs(x[None])[0]
        first = run(ours, x, [(slice(0, 16), 0, True, [(16, 1)])])
        assert torch.equal(pool.conv[:, 1], pool.conv[:, 0]) and torch.equal(pool.recurrent[:, 1], pool.recurrent[:, 0])
        resumed = run(ours, x, [(slice(16, 40), 1, False, [])])
    assert relative_error(torch.cat([first, resumed]), ref) <= 1e-5
