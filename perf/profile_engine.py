"""Where a step's GPU time goes: the top kernels (torch.profiler) of one TTFT request (one image + ISL tokens,
max_tokens=1), of decode steps at a batch size, and of one eager vision encode of several images, with the engine
configured as bench_engine.py configures it.

With programmatic dependent launch on (Hopper), a kernel starts before the one ahead of it ends and its recorded
time includes that wait: at decode batch 1 an H100 profile gave the fused RMSNorm 39 us a call. Run with
TRTLLM_QWENVL_PDL=0 to attribute time per kernel; the total per step is then the PDL-off step's.

    python perf/profile_engine.py --model qwen3_vl_8b --piecewise-graphs --batch 1 --vit-images 8
"""
import argparse
import contextlib
import pathlib
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_engine import (Prompts, decode_steps, encode_items, llm_kwargs, model_dir_for, parse, paused,  # noqa: E402
                          warm, workload)
from trtllm_qwenvl import LLM, SamplingParams  # noqa: E402

ACTIVITIES = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]


def kernel_table(prof, title: str, steps: int, rows: int) -> str:
    """Top kernels by GPU time per step (CPU-side ops left out: under graphs they are not the step's cost)."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    lines = [f"### {title}: {total / 1e3 / steps:.2f} ms GPU per step, {sum(e.count for e in events) / steps:.0f} "
             "kernels per step", "| kernel | ms/step | calls/step | share |", "|---|---|---|---|"]
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        lines.append(f"| {e.key[:90]} | {e.self_device_time_total / 1e3 / steps:.3f} | {e.count / steps:.0f} | "
                     f"{e.self_device_time_total / total:.1%} |")
    return "\n".join(lines)


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--batch", type=int, default=1)
    extra.add_argument("--decode-steps", type=int, default=8)
    extra.add_argument("--vit-images", type=int, default=8)
    extra.add_argument("--rows", type=int, default=15)
    mine, rest = extra.parse_known_args()
    args = parse(rest)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test, no kernels
    work = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for(args, tmp)
        prompts = Prompts(model_dir, work)
        with LLM(model_dir, **llm_kwargs(args, device)) as llm:
            warm(llm, prompts)
            with profile(activities=ACTIVITIES) as ttft:
                llm.generate(prompts.image(), SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            decode = None

            @contextlib.contextmanager
            def around():
                nonlocal decode
                with profile(activities=ACTIVITIES) as decode:
                    yield
            t = time.perf_counter()
            times = decode_steps(llm, prompts, mine.batch, mine.decode_steps + 3, around)
            print(f"decode batch {mine.batch}: {len(times)} profiled steps, {time.perf_counter() - t:.1f}s")
            items = [llm.engine.processor(prompts.image()).mm_items[0] for _ in range(mine.vit_images)]
            with paused(llm) as engine:
                encode_items(engine, items)  # warm: this batch's shapes
                with profile(activities=ACTIVITIES) as vit:
                    encode_items(engine, items)
    print(kernel_table(ttft, f"TTFT request (ISL {work.isl}, one image)", 1, mine.rows))
    print()
    print(kernel_table(decode, f"decode batch {mine.batch}", len(times), mine.rows))
    print()
    print(kernel_table(vit, f"vision encode of {mine.vit_images} images, eager", 1, mine.rows))


if __name__ == "__main__":
    main()
