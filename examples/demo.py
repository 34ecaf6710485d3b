"""`make demo`: build the tiny Qwen2.5-VL checkpoint, then caption the bundled image and video with the LLM API."""
import pathlib
import time

from PIL import Image

from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.inputs.media import load_video
from trtllm_qwenvl.models.tiny import make_tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]
MEDIA = ROOT / "examples" / "media"
CHECKPOINT = ROOT / ".cache" / "tiny" / "qwen2_5_vl"


def user_turn(placeholder: str, text: str) -> str:
    return (f"<|im_start|>user\n<|vision_start|>{placeholder}<|vision_end|>{text}<|im_end|>\n"
            "<|im_start|>assistant\n")


def main() -> None:
    if not (CHECKPOINT / "config.json").exists():
        make_tiny("qwen2_5_vl", CHECKPOINT)
    start = time.perf_counter()
    llm = LLM(str(CHECKPOINT), kv_cache_config={"tokens_per_block": 32})
    print(f"engine ready in {time.perf_counter() - start:.2f}s")
    requests = {
        "image": {"prompt": user_turn("<|image_pad|>", "Describe this image."),
                  "multi_modal_data": {"image": [Image.open(MEDIA / "sample.png")]}},
        "video": {"prompt": user_turn("<|video_pad|>", "What happens in this video?"),
                  "multi_modal_data": {"video": [load_video(str(MEDIA / "sample.mp4"))]}},
    }
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for name, prompt in requests.items():
        out = llm.generate(prompt, params, use_tqdm=False)
        m = out.metrics
        ttft = (m.first_token_time - m.arrival_time) * 1e3
        total = (m.finished_time - m.arrival_time) * 1e3
        n = len(out.outputs[0].token_ids)
        print(f"[{name}] prompt {len(out.prompt_token_ids)} tokens, preprocess {m.preprocess_time * 1e3:.1f} ms, "
              f"TTFT {ttft:.1f} ms, {n} tokens in {total:.1f} ms ({n / (total / 1e3):.1f} tok/s)")
        print(f"[{name}] reply (random weights, so the words are noise): {out.outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()
