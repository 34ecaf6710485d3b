"""`make demo`: serve the tiny Qwen2.5-VL checkpoint, send an image chat and a streamed video chat with the openai
client, print the replies and latencies, and shut the server down."""
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

from trtllm_qwenvl.models.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
MEDIA = ROOT / "examples" / "media"
CHECKPOINT = ROOT / ".cache" / "tiny" / "qwen2_5_vl"
MODEL = "qwen2.5-vl-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trtllm_qwenvl", "serve", str(CHECKPOINT), "--host", "127.0.0.1", "--port", str(port),
           "--served_model_name", MODEL, "--config", str(ROOT / "examples" / "serve_config.yaml"),
           "--allowed_local_media_path", str(MEDIA), "--log_level", "warning"]
    print("$ trtllm-qwenvl serve", " ".join(cmd[4:]))
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Show the server's own lines (its startup line among them) while the demo runs.
    threading.Thread(target=lambda: [print("  [server]", line.rstrip()) for line in server.stdout], daemon=True).start()
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.time() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.2)


def image_chat(client: OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{MEDIA}/sample.png"}},
                                             {"type": "text", "text": "Describe this image."}]}]
    start = time.perf_counter()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0)
    elapsed = time.perf_counter() - start
    u = reply.usage
    print(f"[image] prompt {u.prompt_tokens} tokens, {u.completion_tokens} tokens in {elapsed * 1e3:.0f} ms")
    print(f"[image] reply (random weights, so the words are noise): {reply.choices[0].message.content!r}")


def video_chat(client: OpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{MEDIA}/sample.mp4"}},
                                             {"type": "text", "text": "What happens in this video?"}]}]
    start, first, text, usage = time.perf_counter(), None, "", None
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    total = time.perf_counter() - start
    print(f"[video, streamed] prompt {usage.prompt_tokens} tokens, TTFT {(first - start) * 1e3:.0f} ms, "
          f"{usage.completion_tokens} tokens in {total * 1e3:.0f} ms "
          f"({usage.completion_tokens / total:.0f} tok/s)")
    print(f"[video, streamed] reply: {text!r}")


def main() -> None:
    if not (CHECKPOINT / "config.json").exists():
        make_tiny("qwen2_5_vl", CHECKPOINT)
    port = free_port()
    server = start_server(port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        image_chat(client)
        video_chat(client)
    finally:
        server.terminate()
        server.wait(timeout=30)
        print("server stopped")


if __name__ == "__main__":
    main()
