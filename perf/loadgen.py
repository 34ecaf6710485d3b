#!/usr/bin/env python3
"""Concurrency sweep of streamed image chats against an OpenAI-compatible `/v1/chat/completions`.

Needs only aiohttp (the lent GPU image has it, but neither the openai client nor aiperf). Each request carries one
random-noise PNG (distinct per request, so the prefix and encoder caches miss unless --same-image) and text padded
so that the server-counted prompt is about --isl tokens, image included; `max_tokens` = --osl with `ignore_eos`.
Each level runs --requests-per-level requests closed-loop at its concurrency. Writes `sweep.csv` (one row per level,
the columns perf/sweep_aiperf.sh also writes) and `requests.json` (raw per-request data) to --out, and prints a
markdown table last.

  python3 perf/loadgen.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64,128 --isl 1000 --osl 128 \
      --image-size 512 --out /tmp/sweep
"""
import argparse
import asyncio
import base64
import csv
import json
import math
import pathlib
import random
import struct
import sys
import time
import zlib

import aiohttp

# Common lowercase words: each is one token after a space in Qwen's BPE (checked with --tokenizer), and BPE never
# merges across the space, so the padding's token count is linear in its word count.
WORDS = ("the of and to in is was for that on as with by at from his her an are were which this be or had not but "
         "one all their they has have also more new first after who been its time two into other some over may "
         "only most would she about many out up three years when these made under such between during while can "
         "city world state part war school people team year family water house river land music field game film "
         "line park road town church book season group power light order story court north south east west").split()

COLUMNS = ["concurrency", "requests", "errors", "duration_s", "req_per_s", "output_tok_per_s", "ttft_p50_ms",
           "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "isl_mean", "osl_mean",
           "cached_tokens_mean"]


def make_png(size: int, rng: random.Random) -> str:
    """A size x size RGB noise PNG as a data URI. Noise makes every image distinct, and it does not compress, so
    zlib only stores it (level 0 is fast)."""
    row = size * 3
    raw = b"".join(b"\x00" + rng.randbytes(row) for _ in range(size))  # filter byte 0 (none) per row

    def part(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + part(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
           + part(b"IDAT", zlib.compress(raw, 0)) + part(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def make_payload(args, image: str, n_words: int, rng: random.Random) -> bytes:
    text = " ".join(rng.choice(WORDS) for _ in range(n_words))
    body = {"model": args.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.osl, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": text}]}]}
    return json.dumps(body).encode()


def check_words(tokenizer_dir: str) -> None:
    """Keeps only the words that are exactly one token after a space, so padding is exact for this tokenizer."""
    try:
        from tokenizers import Tokenizer  # comes with transformers; lighter to import
    except ImportError:  # the server-side calibration still sizes the padding, on average
        print("no tokenizers package: --tokenizer ignored", flush=True)
        return
    tok = Tokenizer.from_file(str(pathlib.Path(tokenizer_dir) / "tokenizer.json"))
    WORDS[:] = [w for w in WORDS if len(tok.encode(" " + w, add_special_tokens=False).ids) == 1]
    if len(WORDS) < 20:
        sys.exit(f"only {len(WORDS)} padding words are single tokens for {tokenizer_dir}")


async def send(session: aiohttp.ClientSession, url: str, payload: bytes, timeout: float) -> dict:
    """One streamed request. TTFT is the first chunk with non-empty content (the role-only head chunk does not
    count); ITLs are the gaps between content chunks; tokens come from the usage chunk."""
    rec = {"ttft": None, "itl": [], "e2e": None, "output_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0,
           "chunks": 0, "error": None}
    start = last = time.perf_counter()
    try:
        async with session.post(url, data=payload, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["error"] = f"stream error: {chunk['error'].get('message', '')[:200]}"
                    return rec
                if chunk.get("usage"):
                    u = chunk["usage"]
                    rec["output_tokens"] = u.get("completion_tokens", 0)
                    rec["prompt_tokens"] = u.get("prompt_tokens", 0)
                    rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    if rec["ttft"] is None:
                        rec["ttft"] = now - start
                    else:
                        rec["itl"].append(now - last)
                    last = now
                    rec["chunks"] += 1
        rec["e2e"] = time.perf_counter() - start
        if rec["ttft"] is None or not rec["output_tokens"]:
            rec["error"] = "no content or no usage in the stream"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec["error"] = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:200]
    return rec


async def run_level(session, args, concurrency: int, payloads: list[bytes]) -> tuple[list[dict], float]:
    """Closed loop: `concurrency` workers, each sending its next request as soon as the previous one ends."""
    queue = list(reversed(payloads))
    records = []

    async def worker():
        while queue:
            records.append(await send(session, args.chat_url, queue.pop(), args.timeout))

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return records, time.perf_counter() - start


def pct(xs: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default), NaN for no data."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def summarize(concurrency: int, records: list[dict], duration: float) -> dict:
    ok = [r for r in records if not r["error"]]
    ms = lambda xs, q: round(pct(xs, q) * 1e3, 2)  # noqa: E731
    mean = lambda xs: round(sum(xs) / len(xs), 1) if xs else math.nan  # noqa: E731
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    return {"concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
            "duration_s": round(duration, 3), "req_per_s": round(len(ok) / duration, 3),
            "output_tok_per_s": round(sum(r["output_tokens"] for r in ok) / duration, 1),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p90_ms": ms(ttft, 90), "ttft_p99_ms": ms(ttft, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), "e2e_p50_ms": ms([r["e2e"] for r in ok], 50),
            "isl_mean": mean([r["prompt_tokens"] for r in ok]), "osl_mean": mean([r["output_tokens"] for r in ok]),
            "cached_tokens_mean": mean([r["cached_tokens"] for r in ok])}


def format_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


async def probe_prompt_tokens(session, args, image: str, n_words: int) -> int:
    """The server's prompt token count for an image plus n_words padding words (one output token)."""
    body = json.loads(make_payload(args, image, n_words, random.Random(0)))
    body.update(stream=False, max_tokens=1)
    body.pop("stream_options")
    async with session.post(args.chat_url, json=body, timeout=aiohttp.ClientTimeout(total=args.timeout)) as resp:
        if resp.status != 200:
            sys.exit(f"probe request failed: HTTP {resp.status}: {(await resp.text())[:300]}")
        return (await resp.json())["usage"]["prompt_tokens"]


async def size_padding(session, args, rng) -> int:
    """Words of padding for a prompt of --isl tokens. The image's tokens and the chat template's are measured from
    the server's usage rather than guessed: two probes give the fixed part and the tokens per word."""
    image = make_png(args.image_size, rng)
    base = await probe_prompt_tokens(session, args, image, 8)
    more = await probe_prompt_tokens(session, args, image, 264)
    per_word = (more - base) / 256
    args.fixed_tokens = round(base - 8 * per_word)
    words = max(1, round((args.isl - args.fixed_tokens) / per_word))
    print(f"prompt: {args.fixed_tokens} tokens of image + template, {per_word:.3f} tokens per word -> {words} words "
          f"(isl {args.fixed_tokens + words * per_word:.0f})", flush=True)
    if args.fixed_tokens >= args.isl:
        print(f"warning: the image alone takes {args.fixed_tokens} tokens, over --isl {args.isl}", flush=True)
    return words


async def main(args) -> int:
    rng = random.Random(args.seed)
    args.chat_url = args.url.rstrip("/") + "/v1/chat/completions"
    # limit=0: aiohttp's default pool of 100 connections would cap concurrency 128 silently.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if args.model is None:
            async with session.get(args.url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(30)) as r:
                args.model = (await r.json())["data"][0]["id"]
        if args.tokenizer:
            check_words(args.tokenizer)
        words = await size_padding(session, args, rng)
        shared = make_png(args.image_size, rng) if args.same_image else None

        def payloads(n):  # built before a level starts, so image encoding stays off the timed path
            return [make_payload(args, shared or make_png(args.image_size, rng), words, rng) for _ in range(n)]

        if args.warmup:
            records, _ = await run_level(session, args, args.warmup, payloads(args.warmup))
            failed = [r["error"] for r in records if r["error"]]
            print(f"warm-up: {args.warmup} requests, {len(failed)} failed", flush=True)
            if len(failed) == len(records):
                print(f"every warm-up request failed, first: {failed[0]}")
                return 1
        if args.probe:
            print(f"fixed_tokens={args.fixed_tokens}")
            return 0
        rows, raw = [], []
        for c in args.concurrency:
            n = args.requests_per_level or max(8, 2 * c)
            records, duration = await run_level(session, args, c, payloads(n))
            rows.append(summarize(c, records, duration))
            raw.append({"concurrency": c, "duration_s": duration, "requests": records})
            print(json.dumps(rows[-1]), flush=True)
            for e in sorted({r["error"] for r in records if r["error"]})[:3]:
                print(f"  error: {e}", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    settings = {k: v for k, v in vars(args).items() if k not in ("chat_url", "probe")}
    (out / "requests.json").write_text(json.dumps({"settings": settings, "padding_words": words, "levels": raw}))
    print(f"\nwrote {out / 'sweep.csv'} and {out / 'requests.json'}\n")
    print(format_table(rows))
    return 1 if any(r["errors"] for r in rows) else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64, 128])
    p.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency, at least 8")
    p.add_argument("--warmup", type=int, default=4, help="requests sent (and not recorded) before the sweep")
    p.add_argument("--isl", type=int, default=1000, help="target prompt tokens, image and chat template included")
    p.add_argument("--osl", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--image-size", type=int, default=512, help="side of the square noise image, pixels")
    p.add_argument("--same-image", action="store_true", help="send one image to every request (cache hits)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer dir: keep only single-token padding words")
    p.add_argument("--timeout", type=float, default=600, help="per-request limit, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe", action="store_true",
                   help="only size the padding and warm up; print the image + template tokens (for sweep_aiperf.sh)")
    p.add_argument("--out", default="perf/results/loadgen", help="output directory")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
