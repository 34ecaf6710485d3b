"""Decode-sized linear layers: cuBLAS (torch.nn.functional.linear) against the skinny GEMM kernel at the decoder
shapes of Qwen3-VL-8B and Qwen2.5-VL-7B, as achieved read bandwidth over the weights.

Each variant runs inside a CUDA graph over enough distinct weight copies (>= 512 MB) that nothing is served from
L2, as in a decode step; per-call time is the replay time over the copies. The floor is the weight bytes over the
copy bandwidth measured in the same run. `--sweep` also times a grid of kernel configs and prints the best per
shape, which is how the kernel's DEFAULT config was chosen.

    python3 perf/bench_skinny_gemm.py [--sweep] [--rows 1,2,8,16] [--out DIR]
"""
import argparse
import itertools
import json
import pathlib
import statistics

import torch
import torch.nn.functional as F

from trtllm_qwenvl.kernels.skinny_gemm import DEFAULT, Config, skinny_gemm

SHAPES = {  # name: (N, K), the LM's linears at decode
    "qwen3_vl_8b qkv": (6144, 4096), "qwen3_vl_8b o": (4096, 4096), "qwen3_vl_8b gate_up": (24576, 4096),
    "qwen3_vl_8b down": (4096, 12288), "qwen3_vl_8b lm_head": (151936, 4096),
    "qwen2_5_vl_7b qkv": (4608, 3584), "qwen2_5_vl_7b o": (3584, 3584), "qwen2_5_vl_7b gate_up": (37888, 3584),
    "qwen2_5_vl_7b down": (3584, 18944),
}
SWEEP = [Config(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))]


def graph_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, bytes read + written, timed eagerly as bench_engine does (a captured
    copy becomes a memcpy node, which ran at 2.4 TB/s against 3.0 on an H100)."""
    src = torch.randn(256 * 2 ** 20, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() * 4 / statistics.median(times[2:]) / 1e6


def per_call_ms(weights, x, call) -> float:
    def run():
        for w in weights:
            call(x, w)
    return graph_ms(run) / len(weights)


def try_config(weights, x, config: Config) -> float:
    """us per call, or infinity where the config does not fit the SM (shared memory)."""
    try:
        return 1e3 * per_call_ms(weights, x, lambda a, w: skinny_gemm(a, w, config=config))
    except Exception as e:  # triton's OutOfResources and compile errors alike
        print(f"  {config}: {type(e).__name__}")
        return float("inf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,8,16")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args()
    bw = copy_bandwidth()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e3:.2f} TB/s")
    results = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, 2 ** 29 // nbytes))]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "M": m, "N": n, "K": k, "floor_us": 1e3 * nbytes / bw / 1e6,
                   "cublas_us": 1e3 * per_call_ms(weights, x, lambda a, w: F.linear(a, w)),
                   "skinny_us": 1e3 * per_call_ms(weights, x, lambda a, w: skinny_gemm(a, w)),
                   "config": DEFAULT.__dict__}
            if args.sweep:
                timed = [(try_config(weights, x, c), c) for c in SWEEP]
                best_us, best = min(timed, key=lambda t: t[0])
                row.update(best_us=best_us, best=best.__dict__)
            results.append(row)
            print(json.dumps(row), flush=True)
        del weights
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "skinny_gemm.json").write_text(json.dumps({"copy_GBps": bw, "rows": results}, indent=1))
    print("\n| shape | M | floor us | cuBLAS us (of floor) | skinny us (of floor) | best sweep us | best config |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        best = (f"{r['best_us']:.1f} | {r['best']['block_n']}/{r['best']['block_k']}/{r['best']['num_warps']}"
                f"/{r['best']['num_stages']}") if "best" in r else " | "
        print(f"| {r['shape']} | {r['M']} | {r['floor_us']:.1f} | {r['cublas_us']:.1f} "
              f"({r['floor_us'] / r['cublas_us']:.0%}) | {r['skinny_us']:.1f} ({r['floor_us'] / r['skinny_us']:.0%}) "
              f"| {best} |")


if __name__ == "__main__":
    main()
