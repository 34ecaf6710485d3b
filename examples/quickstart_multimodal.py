"""Offline multimodal generation with the LLM API, with TensorRT-LLM's quickstart flags.

    python examples/quickstart_multimodal.py --model_dir .cache/tiny/qwen2_5_vl --modality image
    python examples/quickstart_multimodal.py --model_dir DIR --modality video --media clip.mp4 --max_tokens 64
"""
import argparse
import os
from pathlib import Path

from trtllm_qwenvl import LLM, SamplingParams

MEDIA = Path(__file__).resolve().parent / "media"
DEFAULTS = {
    "image": ([str(MEDIA / "sample.png")], ["Describe the natural environment in the image."]),
    "video": ([str(MEDIA / "sample.mp4")], ["Tell me what you see in the video briefly."]),
    "multiple_image": ([str(MEDIA / "sample.png")] * 2, ["Describe the difference between the two images."]),
    "mixture_text_image": ([str(MEDIA / "sample.png")], ["Who invented the internet?", "Describe the scene."]),
}


def part(path: str) -> dict:
    kind = "video_url" if Path(path).suffix.lower() in {".mp4", ".mkv", ".mov", ".webm", ".avi"} else "image_url"
    return {"type": kind, kind: {"url": f"file://{Path(path).resolve()}"}}


def conversations(modality: str, media: list[str], prompts: list[str]) -> list[list[dict]]:
    """One conversation per prompt; in mixture_text_image only the last prompt gets the media."""
    if modality == "multiple_image":
        return [[{"role": "user", "content": [*map(part, media), {"type": "text", "text": p}]}] for p in prompts]
    if modality == "mixture_text_image":
        *text_only, last = prompts
        return [[{"role": "user", "content": p}] for p in text_only] + \
            [[{"role": "user", "content": [part(media[0]), {"type": "text", "text": last}]}]]
    return [[{"role": "user", "content": [part(m), {"type": "text", "text": p}]}] for m, p in zip(media, prompts)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", required=True)
    p.add_argument("--modality", choices=sorted(DEFAULTS), default="image")
    p.add_argument("--media", nargs="+", default=None)
    p.add_argument("--prompt", nargs="+", default=None)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max_seq_len", type=int, default=None)
    args = p.parse_args()
    media, prompts = DEFAULTS[args.modality]
    media, prompts = args.media or media, args.prompt or prompts
    if args.modality in ("image", "video") and len(media) != len(prompts):
        prompts = prompts * len(media) if len(prompts) == 1 else prompts
    # The API reads local files only under an allowed dir: allow exactly the one holding the given media.
    allowed = os.path.commonpath([str(Path(m).resolve().parent) for m in media])
    with LLM(args.model_dir, max_seq_len=args.max_seq_len, allowed_local_media_path=allowed) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        for i, out in enumerate(llm.chat(conversations(args.modality, media, prompts), params)):
            print(f"[{i}] prompt tokens {len(out.prompt_token_ids)}, cached {out.num_cached_tokens}")
            print(f"[{i}] {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
