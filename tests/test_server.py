"""The OpenAI server over HTTP on loopback, driven by the real `openai` client, checked against HF transformers."""
import asyncio
import base64
import io
import re
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn
from PIL import Image

from trtllm_qwenvl import LLM
from trtllm_qwenvl.inputs.media import decode_video
from trtllm_qwenvl.serve.openai_server import OpenAIServer

from conftest import MEDIA, chat_prompt

ARCH = "qwen2_5_vl"
MODEL = "tiny-vl"
MAX_SEQ_LEN = 384
MAX_PIXELS = 100_000
NUM_FRAMES = 4
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


class LiveServer:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, server: OpenAIServer):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(server.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    for name in ("sample.png", "sample.mp4"):
        (root / name).write_bytes((MEDIA / name).read_bytes())
    return root


@pytest.fixture(scope="module")
def live(checkpoints, media_dir):
    llm = LLM(checkpoints(ARCH), dtype="float32", max_seq_len=MAX_SEQ_LEN, kv_cache_config={"tokens_per_block": 16},
              allowed_local_media_path=str(media_dir), limit_mm_per_prompt={"image": 2, "video": 1},
              max_media_pixels=MAX_PIXELS, media_io_kwargs={"video": {"num_frames": NUM_FRAMES}})
    server = LiveServer(OpenAIServer(llm, MODEL))
    yield server, llm
    server.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ref(references):
    return references(ARCH)


def data_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "Describe this image.", **extra) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}, **extra},
                                         {"type": "text", "text": text}]}]


def metric(live, name: str, labels: str = "") -> float:
    text = httpx.get(live[0].url + "/metrics").text
    match = re.search(rf"^trtllm_qwenvl_{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def hf_text(ref, prompt: dict, max_tokens: int) -> str:
    return ref.processor.tokenizer.decode(ref.greedy(prompt, max_tokens), skip_special_tokens=True)


def test_models_and_health(client, live):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(live[0].url + "/health").status_code == 200


def test_image_chat_matches_hf_streamed_or_not(client, ref, media):
    image = media["image"]
    messages = image_message(data_uri(image))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = hf_text(ref, {"prompt": chat_prompt(ref.processor, ["image"], "Describe this image."),
                             "multi_modal_data": {"image": [image]}}, 16)
    assert full.choices[0].message.content == expected
    assert streamed == expected
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_repeated_image_reports_cached_prompt_tokens(client, media):
    messages = image_message(data_uri(media["image_b"]), "What is shown?")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == second.choices[0].message.content


def test_video_chat_from_allowed_file_matches_hf(client, ref, media_dir):
    url = f"file://{media_dir / 'sample.mp4'}"
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What happens in this video?"}]}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # The reference sees the frames the server's media_io_kwargs select: num_frames evenly spaced.
    video = decode_video((media_dir / "sample.mp4").read_bytes(), num_frames=NUM_FRAMES)
    assert len(video.frames) == NUM_FRAMES
    prompt = {"prompt": chat_prompt(ref.processor, ["video"], "What happens in this video?"),
              "multi_modal_data": {"video": [{"frames": video.frames, "fps": video.fps}]}}
    assert text == hf_text(ref, prompt, 12)


def test_completions_text_and_token_ids_match_hf(client, ref):
    ids = ref.processor.tokenizer("The capital of France is")["input_ids"]
    with torch.no_grad():
        expected = ref.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):]
    expected_text = ref.processor.tokenizer.decode(expected, skip_special_tokens=True)
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, **GREEDY)
    assert by_text.choices[0].text == expected_text
    assert by_ids.choices[0].text == expected_text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_batched_completions_stream_like_they_return(client):
    """Two prompts x n=2 seeded samples: choices are numbered prompt by prompt, and the streamed deltas of each
    choice add up to the same text as the non-streamed response."""
    args = dict(model=MODEL, prompt=["Once upon a time", "The weather"], max_tokens=6, n=2, seed=3, temperature=1.0)
    full = client.completions.create(**args)
    streamed = {}
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert streamed == {c.index: c.text for c in full.choices}
    assert full.usage.completion_tokens == 24
    echoed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, echo=True, **GREEDY)
    assert echoed.choices[0].text.startswith("Echo me")


def test_n_seeded_samples_are_distinct_and_reproducible(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8, n=3,
                seed=7, temperature=1.0)
    first = client.chat.completions.create(**args)
    second = client.chat.completions.create(**args)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) == 3
    assert first.usage.completion_tokens == 24


def test_chat_logprobs_are_the_model_log_softmax(client, ref):
    messages = [{"role": "user", "content": "Hello"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, logprobs=True,
                                         top_logprobs=3, **GREEDY)
    prompt = ref.processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ref.processor.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(ref.model(input_ids=ids).logits[0, -1].double(), -1)
    top = logprobs.topk(3)
    entry = out.choices[0].logprobs.content[0]
    assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert entry.logprob == pytest.approx(top.values[0].item(), abs=1e-4)  # greedy picks the top token


def oversized_png() -> str:
    return data_uri(Image.new("RGB", (400, 400), (10, 20, 30)))


BAD_REQUESTS = {
    "bad base64": (dict(messages=image_message("data:image/png;base64,@@not-base64@@")), "base64"),
    "not an image": (dict(messages=image_message("data:image/png;base64," + base64.b64encode(b"hello").decode())),
                     "not a decodable image"),
    "not a video": (dict(messages=[{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"x" * 64).decode()}},
        {"type": "text", "text": "?"}]}]), "not a decodable video"),
    "file outside the allowed dir": (dict(messages=image_message(f"file://{MEDIA / 'sample.png'}")),
                                     "outside the allowed local media path"),
    "remote media": (dict(messages=image_message("http://127.0.0.1:9/x.png")), "remote media URLs are not allowed"),
    "too many images": (dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 3}]), "limit_mm_per_prompt"),
    "too many pixels": (dict(messages=image_message(oversized_png())), "max_media_pixels"),
    "over max_seq_len": (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_SEQ_LEN), "max_seq_len"),
    "max_tokens 0": (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=0), "max_tokens"),
    "top_p 0": (dict(messages=[{"role": "user", "content": "hi"}], top_p=0.0), "top_p"),
    "top_p above 1": (dict(messages=[{"role": "user", "content": "hi"}], top_p=1.5), "top_p"),
    "negative temperature": (dict(messages=[{"role": "user", "content": "hi"}], temperature=-0.5), "temperature"),
    "unknown part type": (dict(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {
        "url": "x"}}]}]), "invalid request"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_a_400_and_the_server_keeps_serving(client, live, case):
    kwargs, words = BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert err.value.status_code == 400
    assert words in err.value.body["message"]
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert metric(live, "kv_cache_blocks_used") == 0


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "does not exist" in err.value.body["message"]
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_32_concurrent_image_requests_all_complete(live, media):
    images = [media["image"], media["image_b"], media["image"].transpose(Image.FLIP_LEFT_RIGHT)]
    uris = [data_uri(im) for im in images]

    async def run():
        async with openai.AsyncOpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0) as aclient:
            calls = [aclient.chat.completions.create(model=MODEL, messages=image_message(uris[i % 3], f"Q{i}"),
                                                     max_tokens=8, **GREEDY) for i in range(32)]
            return await asyncio.gather(*calls)

    outs = asyncio.run(run())
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 8 for o in outs)
    assert metric(live, "kv_cache_blocks_used") == 0


def test_client_disconnect_mid_stream_frees_kv_blocks(live):
    aborted = metric(live, "request_finished_total", '{finished_reason="abort"}')
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count forever."}], "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live[0].url + "/v1/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any('"content"' in line for line in seen)
        assert metric(live, "kv_cache_blocks_used") > 0
    deadline = time.time() + 10
    while metric(live, "kv_cache_blocks_used") > 0:
        assert time.time() < deadline, "KV blocks were not freed after the client left"
        time.sleep(0.05)
    assert metric(live, "request_finished_total", '{finished_reason="abort"}') == aborted + 1


def test_client_uuid_keys_the_caches_instead_of_the_pixels(client, media):
    """A different image sent under an earlier image's uuid hits the prefix cache past the image, which only
    happens if the engine keyed the item on the uuid without hashing its pixels; without the uuid it cannot."""
    image = media["image"]
    inverted = Image.fromarray(255 - np.asarray(image))
    text = "Name the colours."
    client.chat.completions.create(model=MODEL, messages=image_message(data_uri(image), text, uuid="item-42"),
                                   max_tokens=1, **GREEDY)
    same_id = client.chat.completions.create(model=MODEL, messages=image_message(data_uri(inverted), text,
                                                                                  uuid="item-42"), max_tokens=1)
    no_id = client.chat.completions.create(model=MODEL, messages=image_message(data_uri(inverted), text),
                                           max_tokens=1)
    image_tokens = (image.width // 28) * (image.height // 28)
    assert no_id.usage.prompt_tokens_details.cached_tokens < same_id.usage.prompt_tokens_details.cached_tokens
    assert same_id.usage.prompt_tokens_details.cached_tokens > image_tokens


def test_metrics_report_latency_and_cache_counters(client, live):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    text = httpx.get(live[0].url + "/metrics").text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_preprocess_seconds_count", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "vision_encoder_seconds_total"):
        assert re.search(rf"^trtllm_qwenvl_{name}", text, re.M), name
    assert metric(live, "time_to_first_token_seconds_count") > 0
    assert metric(live, "vision_encoder_seconds_total") > 0


def test_disabled_vision_encoder_serves_text_and_refuses_media(checkpoints, media):
    with LLM(checkpoints(ARCH), dtype="float32", max_seq_len=MAX_SEQ_LEN, disable_vision_encoder=True) as llm:
        assert llm.engine.model.visual is None
        server = LiveServer(OpenAIServer(llm, MODEL))
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=image_message(data_uri(media["image"])))
            assert "vision encoder disabled" in err.value.body["message"]
            ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
            assert ok.usage.completion_tokens == 2
        finally:
            server.stop()
