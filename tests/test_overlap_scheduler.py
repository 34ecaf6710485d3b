"""The overlap scheduler (on by default): step N+1 is scheduled and launched before step N's tokens are read, and
those tokens feed N+1 on the device. Outputs must be exactly those of the synchronous engine
(`disable_overlap_scheduler`), greedy tokens those of HF transformers, and a request that stops, hits its length,
fails or is aborted while a token is in flight must emit no placeholder and free every block."""
import numpy as np

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.config import LlmArgs
from trtllm_qwenvl.engine.llm_engine import LLMEngine

from conftest import chat_prompt

ARCH = "qwen3_vl"


def engine_args(**kwargs) -> dict:
    return {"dtype": "float32", "max_seq_len": 512, "kv_cache_config": {"tokens_per_block": 16}, **kwargs}


def requests(ref, media) -> list[tuple[dict | str, SamplingParams]]:
    image = {"prompt": chat_prompt(ref.processor, ["image"], "Describe this image."),
             "multi_modal_data": {"image": [media["image"]]}}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = ref.processor.tokenizer.decode(ref.greedy(image, 12), skip_special_tokens=True)
    return [
        (image, greedy),
        ("Count to ten.", SamplingParams(max_tokens=1, temperature=0.0)),
        (image, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=full[len(full) // 2:][:3])),
        ("Tell a story.", SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=3, logprobs=2)),
        ({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=5, temperature=0.0, n=2)),
    ]


def summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]
            for out in outputs]


def test_overlap_matches_the_synchronous_engine_and_hf(checkpoints, references, media):
    ref = references(ARCH)
    reqs = requests(ref, media)
    results = {}
    for overlap in (True, False):
        with LLM(checkpoints(ARCH), **engine_args(disable_overlap_scheduler=not overlap)) as llm:
            outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
            assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
            assert llm.engine.in_flight is None and not llm.engine.has_work()
        results[overlap] = outs
    assert summary(results[True]) == summary(results[False])
    assert results[True][0].outputs[0].token_ids == ref.greedy(reqs[0][0], 12)
    assert results[True][2].outputs[0].finish_reason == "stop"


def test_abort_while_a_token_is_in_flight(checkpoints):
    engine = LLMEngine(LlmArgs.from_kwargs(model=str(checkpoints(ARCH)), **engine_args()))
    assert engine.overlap
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3):
        prompt = {"prompt_token_ids": np.random.default_rng(i).integers(100, 5000, 30).tolist()}
        engine.add(engine.make_sequence(f"r{i}", prompt, params))
    for _ in range(4):
        engine.step()
    seq = engine.states["r1"][0]
    assert engine.in_flight is not None and seq.num_pending == 1  # its next token is being sampled
    out = engine.abort("r1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 3  # the three tokens read back, not the one in flight
    while engine.has_work():
        outputs = engine.step()
        assert all(o.request_id != "r1" for o in outputs)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.scheduler.running == [] and engine.in_flight is None


def test_length_limit_stops_scheduling_the_in_flight_token(checkpoints):
    """A sequence whose in-flight token is its last is not scheduled again: no step computes past max_tokens."""
    engine = LLMEngine(LlmArgs.from_kwargs(model=str(checkpoints(ARCH)), **engine_args()))
    engine.add(engine.make_sequence("r", "Hello there", SamplingParams(max_tokens=2, temperature=0.0)))
    seq = engine.states["r"][0]
    schedule, scheduled = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
    while engine.has_work():
        outputs = engine.step()
    assert seq.finish_reason == "length" and seq.num_output_tokens == 2
    # One prefill step, one decode step, then only the read-back of the last token.
    assert [len(b) for b in scheduled] == [1, 1, 0]
    assert outputs[-1].finished
