"""Parity with HF transformers on tiny random checkpoints: prefill logits and greedy tokens, per architecture,
per scenario, and through the runtime's batching, chunked prefill, prefix caching and preemption."""
import pytest

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.models import tiny

from conftest import chat_prompt, hf_inputs, relative_error, scenarios

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SCENARIOS = ("text", "image", "two_images", "video", "image_video")


@pytest.fixture(scope="module", params=tiny.ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ref(arch, references):
    return references(arch)


@pytest.fixture(scope="module")
def prompts(ref, media):
    return scenarios(ref.processor, media)


@pytest.fixture(scope="module")
def llm(arch, checkpoints):
    with LLM(checkpoints(arch), dtype="float32", kv_cache_config={"tokens_per_block": 16}) as llm:
        yield llm


def capture_logits(llm):
    captured = []
    original = llm.engine.model.compute_logits

    def compute(hidden):
        captured.append(original(hidden))
        return captured[-1]
    llm.engine.model.compute_logits = compute
    return captured, lambda: setattr(llm.engine.model, "compute_logits", original)


@pytest.mark.parametrize("name", SCENARIOS)
def test_prefill_logits(llm, ref, prompts, name):
    captured, restore = capture_logits(llm)
    try:
        llm.generate(prompts[name], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        restore()
    ours = captured[0][0]
    expected = ref.logits(prompts[name])
    assert relative_error(ours, expected) <= 1e-4


@pytest.mark.parametrize("name", SCENARIOS)
def test_greedy_tokens(llm, ref, prompts, name):
    out = llm.generate(prompts[name], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.greedy(prompts[name])
    assert out.outputs[0].text == ref.processor.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_continuous_batching(llm, ref, prompts):
    outs = llm.generate([prompts[n] for n in SCENARIOS], GREEDY, use_tqdm=False)
    for name, out in zip(SCENARIOS, outs):
        assert out.outputs[0].token_ids == ref.greedy(prompts[name]), name


def test_chunked_prefill(arch, checkpoints, ref, prompts):
    # 16-token chunks: smaller than every image's and video's token span, so spans are cut across chunks.
    with LLM(checkpoints(arch), dtype="float32", enable_chunked_prefill=True, max_num_tokens=16,
             kv_cache_config={"tokens_per_block": 16, "enable_block_reuse": False}) as llm:
        outs = llm.generate([prompts[n] for n in SCENARIOS], GREEDY, use_tqdm=False)
        before = llm.engine.encoder.items_encoded
        alone = llm.generate(prompts["image_video"], GREEDY, use_tqdm=False)
        encoded = llm.engine.encoder.items_encoded - before
    for name, out in zip(SCENARIOS, outs):
        assert out.outputs[0].token_ids == ref.greedy(prompts[name]), name
    assert alone.outputs[0].token_ids == ref.greedy(prompts["image_video"])
    # The image and the video each span several 16-token chunks, yet each is encoded exactly once.
    assert encoded == 2


def test_prefix_cache_hit(llm, ref, prompts):
    first = llm.generate(prompts["image"], GREEDY, use_tqdm=False)
    second = llm.generate(prompts["image"], GREEDY, use_tqdm=False)
    assert second.num_cached_tokens > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == ref.greedy(prompts["image"])


def test_different_image_no_false_hit(llm, ref, prompts, media):
    llm.generate(prompts["image"], GREEDY, use_tqdm=False)
    other = dict(prompts["image"], multi_modal_data={"image": [media["image_b"]]})
    out = llm.generate(other, GREEDY, use_tqdm=False)
    first_image_token = out.prompt_token_ids.index(llm.engine.processor.spec.image_token_id)
    assert out.num_cached_tokens <= first_image_token
    assert out.outputs[0].token_ids == ref.greedy(other)


def test_hybrid_prefix_hit_restores_the_image_snapshot(arch, llm, ref, prompts):
    """Hybrids reuse a prefix only where a linear-attention state snapshot exists: a new question about the same
    image restores the one saved at the last block boundary of the image."""
    if arch not in tiny.HYBRID_ARCHS:
        pytest.skip("attention-only models reuse any cached block")
    llm.generate(prompts["image"], GREEDY, use_tqdm=False)
    question = dict(prompts["image"], prompt=chat_prompt(ref.processor, ["image"], "What colour dominates?"))
    out = llm.generate(question, GREEDY, use_tqdm=False)
    ids, image = out.prompt_token_ids, llm.engine.processor.spec.image_token_id
    image_end = len(ids) - ids[::-1].index(image)
    assert 0 < out.num_cached_tokens == image_end // 16 * 16
    assert out.outputs[0].token_ids == ref.greedy(question)


def test_preemption(arch, checkpoints, ref, prompts):
    # A pool that fits the longest request alone, but not the batch.
    longest = max(hf_inputs(ref.processor, prompts[n])["input_ids"].shape[1] for n in SCENARIOS) + 32
    with LLM(checkpoints(arch), dtype="float32", kv_cache_config={"tokens_per_block": 16, "max_tokens": longest}) as llm:
        outs = llm.generate([prompts[n] for n in SCENARIOS], GREEDY, use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        free_after = llm.engine.blocks.num_free_blocks
        total = llm.engine.blocks.num_blocks
        pool = llm.engine.state_pool
        free_slots = len(pool.free_slots) if pool else llm.args.max_batch_size
    assert preemptions > 0
    assert free_after == total
    assert free_slots == llm.args.max_batch_size
    for name, out in zip(SCENARIOS, outs):
        assert out.outputs[0].token_ids == ref.greedy(prompts[name]), name


@pytest.fixture(scope="module")
def llm_no_reuse(arch, checkpoints):
    with LLM(checkpoints(arch), dtype="float32", kv_cache_config={"tokens_per_block": 16,
                                                                  "enable_block_reuse": False}) as llm:
        yield llm


def test_media_encoded_early_once(llm_no_reuse, ref, prompts):
    """The processor announces the image and the video before tokenizing; the engine encodes them then, and the
    request finds them cached."""
    enc = llm_no_reuse.engine.encoder
    early, encoded = enc.items_encoded_early, enc.items_encoded
    out = llm_no_reuse.generate(prompts["image_video"], GREEDY, use_tqdm=False)
    assert enc.items_encoded_early - early == 2 and enc.items_encoded - encoded == 2
    assert not enc.unclaimed and not enc.cache  # claimed by the request, released when it finished
    assert out.outputs[0].token_ids == ref.greedy(prompts["image_video"])


def test_unclaimed_early_outputs_are_bounded(llm_no_reuse, prompts):
    """Outputs no request claims (its preprocessing failed after the announcement) leave the cache oldest first, and
    one early encode stays within the bound."""
    engine = llm_no_reuse.engine
    engine.processor.on_media = None  # build the items without announcing them
    try:
        first, second = engine.processor(prompts["two_images"]).mm_items
    finally:
        engine.processor.on_media = llm_no_reuse.loop.encode_early
    enc = engine.encoder
    with llm_no_reuse.loop.wake:  # the engine thread waits while this one drives it
        bound, enc.max_unclaimed_tokens = enc.max_unclaimed_tokens, max(first.num_tokens, second.num_tokens)
        try:
            engine.encode_early([first])
            assert first.hash in enc.cache
            engine.encode_early([second])
            assert list(enc.unclaimed) == [second.hash] and set(enc.cache) == {second.hash}
            enc.unclaimed.clear()
            enc.cache.clear()
            engine.encode_early([first, second])  # together past the bound: one call encodes the first only
            assert list(enc.unclaimed) == [first.hash] and set(enc.cache) == {first.hash}
        finally:
            enc.max_unclaimed_tokens = bound
            enc.unclaimed.clear()
            enc.cache.clear()


def test_prefix_cached_media_not_encoded_early(llm, ref, prompts):
    """A prompt whose image the prefix cache holds may not use its embeddings: no early encode for it (its step
    encodes the image if the uncached chunk still holds some of its tokens)."""
    llm.generate(prompts["image"], GREEDY, use_tqdm=False)
    enc = llm.engine.encoder
    early = enc.items_encoded_early
    out = llm.generate(prompts["image"], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens > 0
    assert enc.items_encoded_early == early
    assert out.outputs[0].token_ids == ref.greedy(prompts["image"])
