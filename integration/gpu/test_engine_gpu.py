"""The engine on CUDA with the triton backend: decode CUDA graphs against HF transformers and against eager steps,
text-only requests under graphs, and a decode step that never syncs the host before its sampled tokens.

Tiny fp32 checkpoints keep the references exact enough for token identity (the kernels' fp32 dots are IEEE).
"""
import dataclasses

import pytest
import torch

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.config import CudaGraphConfig, LlmArgs
from trtllm_qwenvl.engine.cuda_graphs import capture_sizes
from trtllm_qwenvl.engine.llm_engine import LLMEngine

from engine_refs import GREEDY, hf_reference, scenario_prompts, tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")  # MoE decode runs eagerly until a graph-safe expert kernel lands


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory):
    return tiny_checkpoint(arch, tmp_path_factory)


@pytest.fixture(scope="module")
def ref(checkpoint):
    return hf_reference(checkpoint)


def llm_kwargs(graphs: bool) -> dict:
    return {"dtype": "float32", "cuda_graph_config": {"batch_sizes": [1, 2, 4, 8]} if graphs else None,
            "kv_cache_config": {"tokens_per_block": 16, "max_tokens": 16384}}


def make_llm(checkpoint, graphs: bool):
    return LLM(checkpoint, **llm_kwargs(graphs))


def test_graph_decode_matches_hf_and_eager(checkpoint, ref):
    prompts = scenario_prompts(ref.processor)
    expected = [ref.greedy(p) for p in prompts]
    with make_llm(checkpoint, graphs=True) as llm:
        graphed = llm.generate(prompts, GREEDY, use_tqdm=False)
        graphs = llm.engine.runner.graphs
        replays = graphs.replays
        # A second, different batch replays the same graphs: stale static inputs would show here.
        again = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)
        blocks_free = llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    with make_llm(checkpoint, graphs=False) as llm:
        eager = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.runner.graphs is None
    assert replays > 0 and graphs.replays > replays
    assert blocks_free
    for i, want in enumerate(expected):
        assert graphed[i].outputs[0].token_ids == want, i
        assert eager[i].outputs[0].token_ids == want, i
        assert again[len(prompts) - 1 - i].outputs[0].token_ids == want, i


def test_text_only_requests_run_under_graphs(checkpoint, ref):
    """The trap where text-only decode never reached the graph path: every decode step here must replay."""
    prompt = scenario_prompts(ref.processor)[0]
    with make_llm(checkpoint, graphs=True) as llm:
        out = llm.generate(prompt, GREEDY, use_tqdm=False)
        graphs = llm.engine.runner.graphs
    assert out.outputs[0].token_ids == ref.greedy(prompt)
    assert graphs.replays == GREEDY.max_tokens - 1 and graphs.eager_decodes == 0


def test_padded_batch_sizes_cover_every_batch():
    assert capture_sizes(CudaGraphConfig(), 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(CudaGraphConfig(batch_sizes=[1, 64], max_batch_size=32), 128) == [1]


def test_decode_step_never_syncs_before_sampling(checkpoint, ref):
    prompts = scenario_prompts(ref.processor)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # The engine itself, stepped from this thread (the LLM's loop thread would step it concurrently).
    engine = LLMEngine(LlmArgs.from_kwargs(model=str(checkpoint), **llm_kwargs(graphs=True)))
    for i, p in enumerate(prompts):
        engine.add(engine.make_sequence(f"sync-{i}", p, params))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    engine.step()  # one decode step first, so nothing is compiled or sized lazily below
    torch.cuda.synchronize()
    replays = engine.runner.graphs.replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = engine.step()  # raises on any .item()/.tolist()/blocking copy before the sampled-token read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(outputs) == len(prompts) and engine.runner.graphs.replays == replays + 1
    while engine.has_work():
        engine.step()


def test_piecewise_prefill_graphs_match_hf(arch, checkpoint, ref):
    """Prefill pieces replayed at padded token sizes; chunked prefill, a prefix hit and two different batches."""
    if arch == "qwen3_5":
        pytest.skip("Gated DeltaNet layers keep the eager body")
    kwargs = {**llm_kwargs(graphs=True), "enable_chunked_prefill": True, "max_num_tokens": 256,
              "torch_compile_config": {"enable_piecewise_cuda_graph": True, "capture_num_tokens": [16, 64, 128, 256]}}
    prompts = scenario_prompts(ref.processor)
    expected = [ref.greedy(p) for p in prompts]
    with LLM(checkpoint, **kwargs) as llm:
        piecewise = llm.engine.runner.piecewise
        recorded = {len(piece.recordings) for piece in piecewise.pieces}
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        replays = piecewise.replays
        again = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)
        hit = llm.generate(prompts[1], GREEDY, use_tqdm=False)
        blocks_free = llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert piecewise.compiles == 1 and recorded == {4} and replays > 0 and piecewise.replays > replays
    assert blocks_free and hit.num_cached_tokens > 0
    assert hit.outputs[0].token_ids == expected[1]
    for i, want in enumerate(expected):
        assert first[i].outputs[0].token_ids == want, i
        assert again[len(prompts) - 1 - i].outputs[0].token_ids == want, i


def encode_eager_and_graphed(engine, items):
    """The tower's output for `items` through the encoder graphs, and eagerly from the same device pixels."""
    pixels = engine.encoder.upload(items)
    grids = [item.grid_thw for item in items]
    with torch.inference_mode():
        graphed = engine.encoder.graphs.run(pixels, grids)
        eager = engine.model.encode(pixels, grids)
    return graphed, eager


def test_pixels_normalised_on_the_device_equal_the_hosts(checkpoint, ref):
    """The encoder's input: raw pixels normalised on the GPU equal the same arithmetic on the host, which
    tests/test_input_processor.py holds equal to the HF processor's pixels."""
    engine = LLMEngine(LlmArgs.from_kwargs(model=str(checkpoint), dtype="bfloat16",
                                           kv_cache_config={"max_tokens": 4096}))
    items = [item for p in scenario_prompts(ref.processor)[1:] for item in engine.processor(p).mm_items]
    assert {item.modality for item in items} == {"image", "video"}
    with torch.inference_mode():
        device = engine.encoder.upload(items)
    host = torch.cat([item.norm.apply(item.patches(), torch.bfloat16) for item in items])
    assert device.dtype == torch.bfloat16 and torch.equal(device.cpu(), host)


def test_encoder_graphs_match_eager(checkpoint, ref):
    """bf16 (graphs need the fused varlen attention); different batches replay the same graphs in turn, and a
    batch of the grids just staged, with other pixels, restages only its pixels."""
    config = {"encoder_cuda_graph": {"min_tokens": 64, "max_tokens": 1024, "max_items": 3, "max_frames": 8}}
    engine = LLMEngine(LlmArgs.from_kwargs(model=str(checkpoint), dtype="bfloat16", multimodal_config=config,
                                           kv_cache_config={"max_tokens": 4096}))
    prompts = scenario_prompts(ref.processor)
    items = {name: engine.processor(p).mm_items for name, p in zip(("image", "two", "video", "mixed"), prompts[1:])}
    flipped = [dataclasses.replace(item, pixel_values=item.pixel_values.flip(0).contiguous(), hash=item.hash + 1)
               for item in items["image"]]
    for batch in (items["image"], flipped, items["two"] + items["video"], items["mixed"], items["image"]):
        graphed, eager = encode_eager_and_graphed(engine, batch)
        assert graphed is not None
        assert rel_err(graphed.embeds, eager.embeds) <= 1e-2
        if eager.deepstack is not None:
            assert rel_err(graphed.deepstack, eager.deepstack) <= 1e-2
    graphs = engine.encoder.graphs
    assert graphs.hits == 5 and graphs.misses == 0
    too_many = items["two"] * 2  # 4 items > max_items: eager fallback, counted
    assert graphs.run(engine.encoder.upload(too_many), [i.grid_thw for i in too_many]) is None
    assert graphs.misses == 1


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return float((a.double() - b.double()).norm() / b.double().norm())
