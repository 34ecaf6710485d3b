"""Chat with a running `trtllm-qwenvl serve` through the openai client, with an optional image or video.

    python examples/openai_chat_client.py --image examples/media/sample.png --stream

Local media is sent inline as a base64 data URI, so the server needs no --allowed_local_media_path.
"""
import argparse
import base64
import mimetypes
import time
from pathlib import Path

from openai import OpenAI


def data_uri(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def content(args) -> list[dict]:
    parts = []
    if args.image:
        parts.append({"type": "image_url", "image_url": {"url": data_uri(args.image)}})
    if args.video:
        parts.append({"type": "video_url", "video_url": {"url": data_uri(args.video)}})
    return parts + [{"type": "text", "text": args.prompt}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base_url", default="http://localhost:8000/v1")
    p.add_argument("--model", default=None, help="defaults to the server's only model")
    p.add_argument("--image")
    p.add_argument("--video")
    p.add_argument("--prompt", default="Describe this.")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = args.model or client.models.list().data[0].id
    request = dict(model=model, messages=[{"role": "user", "content": content(args)}], max_tokens=args.max_tokens,
                   temperature=args.temperature)
    start = time.perf_counter()
    if not args.stream:
        reply = client.chat.completions.create(**request)
        print(reply.choices[0].message.content)
        print(f"-- {reply.usage.completion_tokens} tokens in {time.perf_counter() - start:.2f} s")
        return
    first = None
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            print(chunk.choices[0].delta.content, end="", flush=True)
    print(f"\n-- TTFT {(first or time.perf_counter()) - start:.3f} s, total {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
