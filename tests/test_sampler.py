"""Sampler: greedy, top-k / top-p masks, seeded sampling, the sampled distribution and logprobs.

Every expectation comes from an independent float64 reference or from hand-computed values.
"""
import pytest
import torch

from trtllm_qwenvl.engine.sampler import apply_top_k_top_p, gather_logprobs, sample
from trtllm_qwenvl.engine.sequence import ProcessedPrompt, Sequence
from trtllm_qwenvl.inputs.mrope import text_positions
from trtllm_qwenvl.llmapi.sampling_params import SamplingParams


def make_seq(**params) -> Sequence:
    return Sequence("r", ProcessedPrompt([1, 2, 3], [], text_positions(3), 0), SamplingParams(**params))


def ref_keep_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """float64 reference: keep the k largest, then the smallest sorted prefix whose mass reaches top_p."""
    x = logits.double()
    vocab = x.shape[-1]
    k = vocab if top_k <= 0 else min(top_k, vocab)
    order = x.argsort(descending=True)
    probs = x[order][:k].softmax(-1)
    mass_before = torch.cumsum(probs, 0) - probs
    n_keep = int((mass_before < top_p).sum())
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[:n_keep]] = True
    return keep


def masks(logits, top_k, top_p):
    out = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32))
    return out, ~torch.isinf(out)


# ---- greedy ------------------------------------------------------------------------------------------------
def test_all_greedy_batch_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 1.0, 4.0, 0.0], [-2.0, -3.0, -1.0, -1.5]])
    seqs = [make_seq(temperature=0.0) for _ in range(3)]
    assert sample(logits, seqs).tolist() == [1, 0, 2]


def test_greedy_rows_in_mixed_batch_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    seqs = [make_seq(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    tokens = sample(logits, seqs)
    expected = logits.double().argmax(-1)
    for row in (0, 2, 4):
        assert tokens[row] == expected[row], f"greedy row {row} is not the argmax"


# ---- top-k / top-p -----------------------------------------------------------------------------------------
def test_top_k_keeps_exactly_the_k_largest():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    ks = [1, 3, 7, 30]
    out, keep = masks(logits, ks, [1.0] * 4)
    for row, k in enumerate(ks):
        expected = torch.zeros(30, dtype=torch.bool)
        expected[logits[row].double().topk(k).indices] = True
        assert torch.equal(keep[row], expected), f"row {row}: top_k={k} kept the wrong set"
        assert torch.isneginf(out[row][~expected]).all()
        assert torch.equal(out[row][expected], logits[row][expected]), "kept logits must be unchanged"


def test_top_k_zero_and_minus_one_are_off_in_sample():
    # top_k=-1 is documented as "off"; with top_k=1 only the argmax could be sampled, so over many draws
    # a wide distribution must produce several distinct tokens.
    torch.manual_seed(2)
    logits = torch.zeros(200, 4)
    for top_k in (0, -1):
        seqs = [make_seq(temperature=1.0, top_k=top_k)] * 200
        assert len(set(sample(logits, seqs).tolist())) == 4, f"top_k={top_k} should not restrict sampling"


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75, 0.9])
def test_top_p_matches_float64_reference(top_p):
    torch.manual_seed(3)
    logits = torch.randn(8, 40) * 2
    out, keep = masks(logits, [0] * 8, [top_p] * 8)
    for row in range(8):
        expected = ref_keep_mask(logits[row], 0, top_p)
        assert torch.equal(keep[row], expected), f"row {row}: top_p={top_p} kept {keep[row].sum()} tokens, " \
                                                 f"reference keeps {expected.sum()}"
        assert torch.equal(out[row][expected], logits[row][expected])


def test_top_p_hand_computed_prefixes():
    # probs [0.125, 0.5, 0.125, 0.25]: sorted mass before each token is 0, 0.5, 0.75, 0.875.
    logits = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25])).repeat(4, 1)
    _, keep = masks(logits, [0] * 4, [0.45, 0.55, 0.74, 0.76])
    assert keep[0].tolist() == [False, True, False, False]   # the top token alone reaches 0.45
    assert keep[1].tolist() == [False, True, False, True]    # 0.5 < 0.55: the second token is needed
    assert keep[2].tolist() == [False, True, False, True]    # 0.75 reaches 0.74
    assert int(keep[3].sum()) == 3 and keep[3][1] and keep[3][3]  # 0.76 needs a third (tie of tokens 0, 2)


def test_top_k_then_top_p_renormalises_over_the_k_kept():
    torch.manual_seed(4)
    logits = torch.randn(5, 25) * 2
    _, keep = masks(logits, [5] * 5, [0.8] * 5)
    for row in range(5):
        assert torch.equal(keep[row], ref_keep_mask(logits[row], 5, 0.8)), f"row {row}"


def test_top_token_is_never_dropped():
    torch.manual_seed(5)
    logits = torch.randn(4, 100) * 5
    _, keep = masks(logits, [1, 0, 2, 0], [1.0, 1e-6, 1e-6, 0.01])
    top = logits.argmax(-1)
    for row in range(4):
        assert keep[row, top[row]], f"row {row} dropped its top token"
    assert (keep.sum(-1) >= 1).all()
    assert keep[1].sum() == 1 and keep[2].sum() == 1


# Documented: "top_k 0 and top_p 1 leave a row untouched". The nucleus test runs on a float32 cumsum, which
# rounds to 1.0 before the tail of the distribution, so top_p=1.0 (the default) masks low-probability tokens.
def test_top_p_one_keeps_tokens_of_tiny_probability():
    small = torch.tensor([[0.0, -20.0, -25.0]])
    out, keep = masks(small, [0], [1.0])
    assert keep.all(), f"BUG: top_p=1.0 masked low-probability tokens: {out.tolist()}"


def test_top_p_one_keeps_whole_realistic_vocab():
    torch.manual_seed(6)
    logits = torch.randn(2, 151936) * 3
    out, keep = masks(logits, [0, 0], [1.0, 1.0])
    assert keep.all(), f"BUG: top_p=1.0 masked {(~keep).sum(-1).tolist()} of 151936 tokens per row"
    assert torch.equal(out, logits)


# ---- seeds and the sampled distribution --------------------------------------------------------------------
def test_seeded_requests_repeat_regardless_of_batch():
    torch.manual_seed(7)
    logits = torch.randn(50) * 0.5  # wide distribution: different seeds almost surely differ
    other = torch.randn(2, 50)
    a = make_seq(temperature=1.0, seed=1234)
    b = make_seq(temperature=1.0, seed=1234)
    c = make_seq(temperature=1.0, seed=99)
    neighbours = [make_seq(temperature=0.8), make_seq(temperature=1.2, top_k=5, seed=7)]
    alone, batched, other_seed = [], [], []
    for step in range(20):
        torch.manual_seed(step)  # the global RNG state must not matter for seeded rows
        alone.append(int(sample(logits[None], [a])[0]))
        torch.manual_seed(1000 + step)
        batch = torch.stack([other[0], logits, other[1]])
        batched.append(int(sample(batch, [neighbours[0], b, neighbours[1]])[1]))
        other_seed.append(int(sample(logits[None], [c])[0]))
    assert alone == batched, "the same seed must give the same tokens whatever else is in the batch"
    assert alone != other_seed, "a different seed should give a different token stream"


@pytest.mark.parametrize("temperature", [0.7, 1.0])  # 1.0 skips the division
def test_sample_distribution_matches_softmax_with_temperature(temperature):
    torch.manual_seed(8)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n = 4000
    seqs = [make_seq(temperature=temperature)] * n
    tokens = sample(logits.repeat(n, 1), seqs)
    empirical = torch.bincount(tokens, minlength=5).double() / n
    expected = (logits.double() / temperature).softmax(-1)
    # standard error <= sqrt(0.25 / 4000) ~ 0.008
    assert (empirical - expected).abs().max() < 0.03, f"empirical {empirical.tolist()} vs {expected.tolist()}"


def test_sample_never_picks_masked_tokens():
    torch.manual_seed(9)
    logits = torch.randn(20).repeat(500, 1)
    tokens = sample(logits, [make_seq(temperature=2.0, top_k=3)] * 500)
    allowed = set(logits[0].double().topk(3).indices.tolist())
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) == 3


# ---- logprobs ----------------------------------------------------------------------------------------------
def test_gather_logprobs_matches_float64_log_softmax():
    torch.manual_seed(10)
    logits = torch.randn(4, 64) * 4
    tokens = torch.tensor([0, 5, 63, 17])
    chosen, top_ids, top_values = gather_logprobs(logits, tokens, 3)
    ref = logits.double().log_softmax(-1)
    torch.testing.assert_close(chosen.double(), ref[torch.arange(4), tokens], atol=1e-5, rtol=0)
    ref_values, ref_ids = ref.topk(3, dim=-1)
    assert torch.equal(top_ids, ref_ids)
    torch.testing.assert_close(top_values.double(), ref_values, atol=1e-5, rtol=0)


def test_gather_logprobs_with_zero_top():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    chosen, top_ids, top_values = gather_logprobs(logits, torch.tensor([2]), 0)
    expected = 2.0 - torch.log(torch.tensor([1.0, 2.718281828459045, 7.38905609893065]).double().sum())
    assert abs(float(chosen[0]) - float(expected)) < 1e-6
    assert top_ids.shape == (1, 0) and top_values.shape == (1, 0)


# ---- validation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.01},
    {"top_p": -0.5}, {"top_k": -2}, {"logprobs": -1},
])
def test_validate_rejects_bad_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).validate()


@pytest.mark.parametrize("kwargs", [
    {}, {"max_tokens": 1}, {"temperature": 0.0}, {"top_p": 1.0}, {"top_p": 1e-3}, {"top_k": -1}, {"top_k": 0},
    {"top_k": 50}, {"logprobs": 0},
])
def test_validate_accepts_edge_values(kwargs):
    SamplingParams(**kwargs).validate()  # must not raise
    assert SamplingParams(**kwargs).greedy == (kwargs.get("temperature", 1.0) == 0)


def test_stop_string_is_normalised_to_list():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=None).stop == []
