"""Host time of preprocessing one image prompt (the part of TTFT before the engine sees the request): the whole
`InputProcessor` call against its parts and against the HF processor it stands in for, the image processor on the
host (as the engine runs it) and on the GPU, then cProfile's top functions. Each part is timed back to back and
after an idle gap, with torch's default CPU threads and with one: requests arrive with gaps, and after one the
intra-op (OpenMP) threads of the image processor's torch ops must be woken again.

    python perf/profile_preprocess.py --model qwen3_vl_8b
"""
import argparse
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_engine import Prompts, Workload  # noqa: E402
from model_shapes import SHAPES, make_shape_dir  # noqa: E402
from trtllm_qwenvl.inputs.pixels import RAW  # noqa: E402
from trtllm_qwenvl.inputs.processor import InputProcessor  # noqa: E402


def median_ms(fn, prompts: Prompts, iters: int, idle_s: float = 0.0) -> float:
    times = []
    for _ in range(iters):
        prompt = prompts.image()  # a fresh image each call: nothing is cached between calls
        time.sleep(idle_s)
        t = time.perf_counter()
        fn(prompt)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_vl_8b", choices=sorted(SHAPES))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--idle-ms", type=float, default=40.0,
                   help="idle time before each call in the 'after idle' columns (a TTFT request is ~40 ms apart)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_shape_dir(args.model, pathlib.Path(tmp) / args.model)
        prompts = Prompts(model_dir, Workload())
        config = transformers.AutoConfig.from_pretrained(model_dir)
        ours = InputProcessor(str(model_dir), config)
        hf = ours.processor
        as_engine = InputProcessor(str(model_dir), config, ours.tokenizer, pin_pixels=device.type == "cuda")
        parts = {
            "InputProcessor (all of it)": ours,
            "InputProcessor as a GPU engine runs it (pixels pinned)": as_engine,
            "HF processor (tokens + pixels)": lambda q: hf(text=[q["prompt"]], images=q["multi_modal_data"]["image"]),
            "ours: image processor + tokenizer + expansion": lambda q: ours.process_images(
                q["prompt"], q["multi_modal_data"]["image"]),
            "HF image processor alone, on the device": lambda q: hf.image_processor(
                q["multi_modal_data"]["image"], device=str(device), return_tensors="pt"),
            "HF image processor alone, on the host": lambda q: hf.image_processor(
                q["multi_modal_data"]["image"], return_tensors="pt"),
            "HF image processor alone, on the host, raw (as ours runs it)": lambda q: hf.image_processor(
                q["multi_modal_data"]["image"], return_tensors="pt", **RAW),
            "tokenizer alone (prompt before expansion)": lambda q: ours.tokenizer(q["prompt"]),
        }
        rows = {name: [] for name in parts}
        threads = torch.get_num_threads()
        for n in (threads, 1):
            torch.set_num_threads(n)
            for name, fn in parts.items():
                median_ms(fn, prompts, 3)
                rows[name] += [median_ms(fn, prompts, args.iters),
                               median_ms(fn, prompts, args.iters, args.idle_ms / 1e3)]
        torch.set_num_threads(threads)
        profiler = cProfile.Profile()
        prompt = prompts.image()
        profiler.runcall(ours, prompt)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.rows)
    print(text.getvalue())
    idle = f"{args.idle_ms:g} ms idle"
    print(f"| part ({device}), ms | {threads} threads, back to back | {threads} threads, after {idle} "
          f"| 1 thread, back to back | 1 thread, after {idle} |\n|---|---|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in ms) + " |")


if __name__ == "__main__":
    main()
