"""The LLM API contract: chat, streaming, stops, logprobs, seeds, the text-only fast path, and bad input."""
import asyncio
import base64
import gc
import io
import json
import shutil

import pytest
import torch

from trtllm_qwenvl import LLM, SamplingParams

from conftest import chat_prompt

ARCH = "qwen3_vl"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ref(references):
    return references(ARCH)


@pytest.fixture(scope="module")
def llm(checkpoints):
    with LLM(checkpoints(ARCH), dtype="float32", max_seq_len=512, kv_cache_config={"tokens_per_block": 16}) as llm:
        yield llm


@pytest.fixture(scope="module")
def image_prompt(ref, media):
    return {"prompt": chat_prompt(ref.processor, ["image"], "Describe this image."),
            "multi_modal_data": {"image": [media["image"]]}}


def free_blocks(llm) -> int:
    return llm.engine.blocks.num_free_blocks


def test_text_only_fast_path_skips_the_hf_processor(checkpoints):
    with LLM(checkpoints(ARCH), dtype="float32") as llm:
        seq = llm.engine.make_sequence("t", "Hello there", GREEDY)
        llm.generate("Hello there", GREEDY, use_tqdm=False)
        assert llm.engine.processor._processor is None
    assert seq.prompt.mrope_positions.tolist() == [list(range(len(seq.token_ids)))] * 3
    assert seq.prompt.mrope_delta == 0


def test_startup_objects_are_out_of_the_collectors_reach(llm):
    """Start-up ends with gc.freeze(): the model is no longer in any generation the collector scans."""
    assert gc.get_freeze_count() > 0
    assert all(o is not llm.engine.model for o in gc.get_objects())


def test_prompt_token_ids_input(llm, ref):
    ids = ref.processor.tokenizer("The capital of France is")["input_ids"]
    out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    with torch.no_grad():
        expected = ref.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == expected.tolist()


def test_chat_with_image_matches_hf(llm, ref, media):
    buf = io.BytesIO()
    media["image"].save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "Describe this image."}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)
    expected = {"prompt": chat_prompt(ref.processor, ["image"], "Describe this image."),
                "multi_modal_data": {"image": [media["image"]]}}
    assert out.outputs[0].token_ids == ref.greedy(expected, 16)


def test_streaming_diffs_add_up(llm, image_prompt):
    async def collect():
        return [o async for o in llm.generate_async(image_prompt, GREEDY, streaming=True)]
    outs = asyncio.run(collect())
    final = llm.generate(image_prompt, GREEDY, use_tqdm=False)
    assert len(outs) == 16 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].text_diff for o in outs) == final.outputs[0].text
    assert [t for o in outs for t in o.outputs[0].token_ids_diff] == final.outputs[0].token_ids


def test_cancelled_stream_frees_its_blocks(llm, image_prompt):
    before = free_blocks(llm)

    async def take_two():
        stream = llm.generate_async(image_prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                                    streaming=True)
        async for out in stream:
            if len(out.outputs[0].token_ids) == 2:
                break
        await stream.aclose()
    asyncio.run(take_two())
    llm.generate("sync point", GREEDY, use_tqdm=False)  # the abort is processed before this request finishes
    assert free_blocks(llm) == before


def test_stop_string_and_stop_token(llm, ref, image_prompt):
    full = llm.generate(image_prompt, GREEDY, use_tqdm=False).outputs[0]
    text = ref.processor.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = llm.generate(image_prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stop),
                       use_tqdm=False).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]
    token = full.token_ids[5]
    out = llm.generate(image_prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                    stop_token_ids=[token]), use_tqdm=False).outputs[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_logprobs_match_hf(llm, ref, image_prompt):
    out = llm.generate(image_prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3),
                       use_tqdm=False).outputs[0]
    expected = ref.logits(image_prompt).double().log_softmax(-1)
    top = expected.topk(3)
    token = out.token_ids[0]
    assert abs(out.logprobs[0][token] - float(expected[token])) < 1e-4
    assert sorted(out.logprobs[0]) == sorted(top.indices.tolist())
    assert abs(out.cumulative_logprob - float(expected[token])) < 1e-4


def test_seeded_sampling_is_reproducible(llm, image_prompt):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate(image_prompt, params, use_tqdm=False).outputs[0].token_ids
    b, _ = llm.generate([image_prompt, "another request in the batch"], params, use_tqdm=False)
    assert a == b.outputs[0].token_ids


def test_eos_stops_generation(llm, image_prompt):
    eos = next(iter(llm.engine.eos_ids))
    full = llm.generate(image_prompt, GREEDY, use_tqdm=False).outputs[0]
    llm.engine.eos_ids.add(full.token_ids[3])
    try:
        out = llm.generate(image_prompt, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False).outputs[0]
    finally:
        llm.engine.eos_ids.discard(full.token_ids[3])
    assert eos in llm.engine.eos_ids
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:full.token_ids.index(full.token_ids[3]) + 1]


@pytest.mark.parametrize("case", ["placeholders", "too_long", "max_tokens", "modality", "empty"])
def test_bad_input_raises_and_engine_stays_usable(llm, media, image_prompt, case):
    before = free_blocks(llm)
    bad = {
        "placeholders": (dict(image_prompt, multi_modal_data={"image": [media["image"], media["image"]]}), GREEDY),
        "too_long": ("word " * 600, GREEDY),
        "max_tokens": ("hello", SamplingParams(max_tokens=0)),
        "modality": (dict(image_prompt, multi_modal_data={"audio": [b"x"]}), GREEDY),
        "empty": ({"prompt_token_ids": []}, GREEDY),
    }[case]
    with pytest.raises(ValueError) as err:
        llm.generate([image_prompt, bad[0]], bad[1], use_tqdm=False)
    assert str(err.value)
    assert free_blocks(llm) == before
    assert llm.generate(image_prompt, GREEDY, use_tqdm=False).outputs[0].finish_reason == "length"


def test_failed_step_frees_blocks_and_reports(llm, image_prompt, monkeypatch):
    before = free_blocks(llm)
    monkeypatch.setattr(llm.engine.runner, "run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(image_prompt, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert free_blocks(llm) == before
    assert llm.generate(image_prompt, GREEDY, use_tqdm=False).outputs[0].finish_reason == "length"


def test_failed_schedule_fails_its_requests_and_frees_blocks(llm, image_prompt, monkeypatch):
    before = free_blocks(llm)
    monkeypatch.setattr(llm.engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("no plan")))
    with pytest.raises(RuntimeError, match="no plan"):
        llm.generate(image_prompt, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert free_blocks(llm) == before and not llm.engine.has_work()
    assert llm.generate(image_prompt, GREEDY, use_tqdm=False).outputs[0].finish_reason == "length"


def test_unsupported_architecture(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints(ARCH), bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["Qwen3VLForSomethingElse"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(bad, dtype="float32")
