"""The LM body compiled in pieces around attention (`torch_compile_config`), on CPU: the pieces run without CUDA
graphs here, but steps are padded to the capture sizes exactly as on GPU. Greedy tokens must match HF transformers
across every scenario, chunked prefill and a prefix hit."""
import pytest
import torch

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.engine.piecewise_graphs import Call, PiecewiseGraphs, replay_inputs

from conftest import relative_error, scenarios

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SCENARIOS = ("text", "image", "two_images", "video", "image_video")
SIZES = [16, 48, 96]


def piecewise_llm(checkpoint, **kwargs):
    return LLM(checkpoint, dtype="float32", torch_compile_config={"enable_piecewise_cuda_graph": True,
                                                                   "capture_num_tokens": SIZES},
               kv_cache_config={"tokens_per_block": 16}, **kwargs)


@pytest.fixture()
def step_sizes(monkeypatch):
    """Token counts the compiled body ran with, and how many of those steps skipped dynamo's entry (the first of
    each size goes through it)."""
    seen, direct = [], []
    forward, run = PiecewiseGraphs.forward, Call.run

    def counted_forward(self, positions, embeds, size):
        seen.append(embeds.shape[0])
        return forward(self, positions, embeds, size)

    def counted_run(self, positions, embeds):
        direct.append(embeds.shape[0])
        return run(self, positions, embeds)
    monkeypatch.setattr(PiecewiseGraphs, "forward", counted_forward)
    monkeypatch.setattr(Call, "run", counted_run)
    return seen, direct


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_piecewise_matches_hf(arch, checkpoints, references, media, step_sizes):
    ref = references(arch)
    prompts = scenarios(ref.processor, media)
    # 96-token chunks: long prompts are cut, the rest pad up to 16, 48 or 96 tokens.
    with piecewise_llm(checkpoints(arch), enable_chunked_prefill=True, max_num_tokens=96) as llm:
        outs = llm.generate([prompts[n] for n in SCENARIOS], GREEDY, use_tqdm=False)
        runner = llm.engine.runner
        assert len(runner.piecewise.pieces) == len(runner.attn_layers) + 1
        again = llm.generate(prompts["image"], GREEDY, use_tqdm=False)
        captured = []
        original = llm.engine.model.compute_logits
        llm.engine.model.compute_logits = lambda hidden: captured.append(original(hidden)) or captured[-1]
        llm.generate(prompts["two_images"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    for name, out in zip(SCENARIOS, outs):
        assert out.outputs[0].token_ids == ref.greedy(prompts[name]), name
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == ref.greedy(prompts["image"])
    assert relative_error(captured[-1][0], ref.logits(prompts["two_images"])) <= 1e-4
    seen, direct = step_sizes
    assert set(seen) <= set(SIZES) and len(set(seen)) > 1
    assert len(direct) == len(seen) - len(set(seen))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_vl_moe"])
def test_untraceable_layers_keep_the_eager_body(arch, checkpoints, caplog):
    with piecewise_llm(checkpoints(arch)) as llm:
        assert llm.engine.runner.piecewise is None
        out = llm.generate("Hello", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert "piecewise prefill graphs off" in caplog.text


def test_replays_compare_host_scalars_by_value():
    """After two models with different norm eps in one process, dynamo passes eps to the pieces as a fresh host
    scalar every call: a replay must accept the same value at a new address and refuse a new value (the capture
    baked the old one in). Tensors are compared by address."""
    def eps(value):
        return torch.tensor(value, dtype=torch.float64)
    x = torch.zeros(4)
    assert replay_inputs([x, eps(1e-6), 3]) == replay_inputs([x, eps(1e-6), 3]) == [x.data_ptr(), 1e-6]
    assert replay_inputs([x, eps(1e-6)]) != replay_inputs([x, eps(1e-5)])
    assert replay_inputs([x]) != replay_inputs([torch.zeros(4)])
