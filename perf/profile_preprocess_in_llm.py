"""Preprocessing time inside a live LLM: the engine's InputProcessor and its parts, timed in `LLM.pool` and on the
main thread, right after a TTFT request, after an idle gap and back to back, next to the TTFT loop's own split.

The same host work measured alone (`profile_preprocess.py`) is faster than inside the LLM; this script keeps the
engine, its threads and its GPU work alive around each measurement to find where the difference comes from.

    python3 perf/profile_preprocess_in_llm.py [--model qwen3_vl_8b] [--iters 15]
"""
import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_engine as bench  # noqa: E402
from trtllm_qwenvl import LLM, SamplingParams  # noqa: E402
from trtllm_qwenvl.inputs.pixels import RAW  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def parts(proc) -> dict:
    """The parts of preprocessing one image prompt (and the whole), each a call on the prompt."""
    image_processor = proc.processor.image_processor
    return {
        "InputProcessor (all of it)": proc,
        "image processor, normalising": lambda q: image_processor(images=q["multi_modal_data"]["image"],
                                                                  return_tensors="pt"),
        "image processor, raw": lambda q: image_processor(images=q["multi_modal_data"]["image"],
                                                          return_tensors="pt", **RAW),
        "tokenizer": lambda q: proc.tokenizer(q["prompt"]),
    }


def timed(fn, prompt) -> float:
    t = time.perf_counter()
    fn(prompt)
    return time.perf_counter() - t


def measure(prompts, iters: int, before, where, fn) -> tuple[float, float]:
    """`fn` alone, `iters` times, each on a fresh prompt right after `before` ran on another."""
    times = []
    for _ in range(iters):
        before(prompts.image())
        times.append(where(lambda q: timed(fn, q), prompts.image()))
    return summary(times)


def ttft_split(llm: LLM, prompts, iters: int) -> dict:
    walls, prep, engine = [], [], []
    for _ in range(iters):
        t = time.perf_counter()
        out = llm.generate(prompts.image(), ONE_TOKEN, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        prep.append(out.metrics.preprocess_time)
        engine.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return {"TTFT wall": summary(walls), "preprocessing (in LLM.pool)": summary(prep), "engine": summary(engine)}


def summary(seconds: list[float]) -> tuple[float, float]:
    """Median and p90, in ms."""
    return (round(1e3 * statistics.median(seconds), 2), round(1e3 * sorted(seconds)[9 * len(seconds) // 10], 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_vl_8b", choices=[*bench.SHAPES, "tiny"])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--idle-ms", type=float, default=40.0)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    flags = ["--model", args.model] + (["--cuda-graphs", "--piecewise-graphs", "--encoder-graphs"] if cuda else [])
    bargs = bench.parse(flags)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench.model_dir_for(bargs, tmp)
        prompts = bench.Prompts(model_dir, bench.workload(bargs))
        with LLM(model_dir, **bench.llm_kwargs(bargs, torch.device("cuda" if cuda else "cpu"))) as llm:
            bench.warm(llm, prompts)
            request = lambda q: llm.generate(q, ONE_TOKEN, use_tqdm=False)  # noqa: E731
            idle = lambda q: time.sleep(args.idle_ms / 1e3)  # noqa: E731
            in_pool = lambda fn, q: llm.pool.submit(fn, q).result()  # noqa: E731
            on_main = lambda fn, q: fn(q)  # noqa: E731
            rows = {"TTFT loop": ttft_split(llm, prompts, args.iters)}
            for name, before, where in (("in the pool, right after a request", request, in_pool),
                                        ("on the main thread, right after a request", request, on_main),
                                        (f"in the pool, after {args.idle_ms:g} ms idle", idle, in_pool),
                                        (f"on the main thread, after {args.idle_ms:g} ms idle", idle, on_main),
                                        ("on the main thread, back to back", lambda q: None, on_main)):
                rows[name] = {part: measure(prompts, args.iters, before, where, fn)
                              for part, fn in parts(llm.engine.processor).items()}
    print("\n| where | part | median ms | p90 ms |\n|---|---|---|---|")
    for where, parts_ms in rows.items():
        for part, (median, p90) in parts_ms.items():
            print(f"| {where} | {part} | {median} | {p90} |")


if __name__ == "__main__":
    main()
