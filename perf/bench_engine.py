"""In-process engine benchmark at real model shapes with dummy bf16 weights, against the roofline and HF (issue 5).

Sections (`--sections`, run in the order g, f, a, b, e, d, c so HF has the GPU to itself before our engine takes
its KV pool):
  a  TTFT at c=1: one noise image + digits to ISL tokens, max_tokens=1 (end to end, and engine-only)
  b  decode ms/step at batch 1, 8, 32, 128 (text prompts of ISL tokens; steps timed once all sequences decode)
  c  output tok/s at c = 1..128, ISL with one image, each OSL, EOS ignored (at most c requests in flight)
  d  ViT encode latency p50/p99 for 1 and 8 images through the engine's encoder runner (wall time between syncs)
  e  host time per decode step (step wall minus the wait for the sampled tokens) vs GPU kernel time per step
  f  HF transformers (random init, sdpa) on (a), (b) at batch 1 and (c) at the largest c and smallest OSL
  g  measured copy bandwidth and bf16 matmul rate; every figure gets its floor from them

    python perf/bench_engine.py --model qwen3_vl_8b                  # full run on the GPU
    python perf/bench_engine.py --model qwen3_vl_8b --quick --sections a,b,g
    python perf/bench_engine.py --model tiny --quick --out /tmp/bench # CPU smoke test of every code path

Graph settings come from flags (--cuda-graphs, --piecewise-graphs, --encoder-graphs) so one script compares
on and off; `--llm-args JSON` passes any other LLM argument.
"""
import argparse
import contextlib
import datetime
import gc
import itertools
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import transformers
from PIL import Image

from model_shapes import SHAPES, make_shape_dir, params_on_meta
from trtllm_qwenvl import LLM, SamplingParams
from trtllm_qwenvl.config import LlmArgs
from trtllm_qwenvl.engine.state_pool import bytes_per_slot, gdn_layers
from trtllm_qwenvl.layers.attention import Attention
from trtllm_qwenvl.models import tiny
from trtllm_qwenvl.models.registry import resolve

REPO = pathlib.Path(__file__).resolve().parents[1]
SECTION_ORDER = "gfabedc"
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
WARM_STEPS = 2
CAPPED_TIMEOUT_S = 300  # a wedged engine must not eat the device budget


@dataclass
class Workload:
    isl: int = 1000
    image_size: int = 512
    ttft_runs: int = 20   # TTFT varied by up to 4 ms between groups of 5 in one process (results/experiments_*)
    decode_batches: tuple = (1, 8, 32, 128)
    decode_tokens: int = 64
    concurrency: tuple = (1, 8, 32, 64, 128)
    osl: tuple = (128, 1000)
    rounds: int = 2            # requests per concurrency level = rounds * c
    vit_images: tuple = (1, 8)
    vit_iters: int = 100


QUICK = dict(ttft_runs=2, decode_batches=(1, 8), decode_tokens=16, concurrency=(1, 8), osl=(32,), rounds=1,
             vit_iters=10)
TINY = dict(isl=200, image_size=128, decode_batches=(1, 4), decode_tokens=8, concurrency=(1, 4), osl=(8,),
            vit_iters=5)


@dataclass
class Roofline:
    bandwidth: float   # bytes/s, D2D copy (read + write)
    matmul: float      # flop/s, bf16 GEMM


@dataclass
class ModelStats:
    params: int
    vision_params: int
    body_params: int          # decoder layers + final norm: read every step, 2 flops per token each
    head_params: int          # LM head (vocab x hidden)
    bytes_per_param: int
    kv_bytes_per_token: int
    state_bytes: int          # linear-attention state per sequence (Qwen3.5), read and written every step
    attn_flops_per_pair: int  # sum over attention layers of 2 * heads * head_dim: causal prefill costs this * L^2
    image_patches: int
    image_tokens: int

    @property
    def decode_bytes(self) -> int:
        return (self.body_params + self.head_params) * self.bytes_per_param


# ---- timing ---------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device: torch.device, iters: int, warmup: int = 2, events: bool = True) -> list[float]:
    """Seconds per call: CUDA events on GPU (device time of the current stream), else perf_counter between syncs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda" and events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(wall(fn, device))
    return times


def wall(fn, device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def percentile(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


class KernelTimer:
    """GPU busy time inside the block: the union of the profiler's device event intervals (kernels, memcpy,
    memset). A union rather than a sum: kernels launched with programmatic dependent launch start while their
    predecessor finishes and wait on it, so their intervals overlap."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.prof.__exit__(*exc)
        device_events = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        self.seconds = busy_us(sorted((e.time_range.start, e.time_range.end) for e in device_events)) / 1e6


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of sorted (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# ---- prompts --------------------------------------------------------------------------------------------------
def noise_image(size: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class Prompts:
    """Distinct prompts (so the prefix cache never hits): a fresh noise image, then random digits, one token each in
    the Qwen tokenizers, filling the prompt to ISL tokens."""

    def __init__(self, model_dir, work: Workload):
        self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        self.work, self.seeds = work, itertools.count(1)
        probe = self.processor(text=[chat(IMAGE_PART)], images=[noise_image(work.image_size, 0)], return_tensors="np")
        self.fill = max(work.isl - probe["input_ids"].shape[1], 1)
        self.image_patches = int(np.prod(probe["image_grid_thw"][0]))
        self.image_tokens = self.image_patches // self.processor.image_processor.merge_size ** 2

    def image(self) -> dict:
        seed = next(self.seeds)
        digits = "".join(map(str, np.random.default_rng(seed).integers(0, 10, self.fill)))
        image = noise_image(self.work.image_size, seed)
        return {"prompt": chat(IMAGE_PART + digits), "multi_modal_data": {"image": [image]}}

    def text(self) -> dict:
        ids = np.random.default_rng(next(self.seeds)).integers(1000, 100000, self.work.isl)
        return {"prompt_token_ids": ids.tolist()}


# ---- model stats and floors -----------------------------------------------------------------------------------
def model_stats(model_dir, prompts: Prompts, dtype: torch.dtype) -> ModelStats:
    """Parameter and cache sizes of our model class, built with meta parameters (nothing allocated)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with params_on_meta():
        model = resolve(config)(config)
    lm = model.language_model
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    size = torch.finfo(dtype).bits // 8
    gdn = gdn_layers(model)
    return ModelStats(
        params=sum(p.numel() for p in model.parameters()),
        vision_params=sum(p.numel() for p in model.visual.parameters()) if model.visual is not None else 0,
        body_params=sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel(),
        head_params=model.lm_head.weight.numel(), bytes_per_param=size,
        kv_bytes_per_token=sum(2 * m.num_kv_heads * m.head_dim for m in attn) * size,
        state_bytes=2 * bytes_per_slot(gdn, dtype) if gdn else 0,
        attn_flops_per_pair=sum(2 * m.num_heads * m.head_dim for m in attn),
        image_patches=prompts.image_patches, image_tokens=prompts.image_tokens)


def decode_floor(s: ModelStats, roof: Roofline, batch: int, ctx: float) -> float:
    """Seconds per decode step: weights + every sequence's KV (and state) once, or the GEMMs, whichever is slower."""
    memory = (s.decode_bytes + batch * (ctx * s.kv_bytes_per_token + s.state_bytes)) / roof.bandwidth
    compute = 2 * (s.body_params + s.head_params) * batch / roof.matmul
    return max(memory, compute)


def prefill_flops(s: ModelStats, tokens: int, images: int) -> float:
    """One sequence: linear layers, causal attention, the ViT's linear layers and one LM-head row (the ViT's
    attention and the linear-attention recurrence are left out, so this stays a lower bound)."""
    return (2 * s.body_params * tokens + s.attn_flops_per_pair * tokens ** 2 + 2 * s.head_params
            + images * 2 * s.vision_params * s.image_patches)


def prefill_floor(s: ModelStats, roof: Roofline, tokens: int, images: int) -> float:
    return max(prefill_flops(s, tokens, images) / roof.matmul, s.params * s.bytes_per_param / roof.bandwidth)


def throughput_floor(s: ModelStats, roof: Roofline, c: int, isl: int, osl: int) -> float:
    """Output tok/s at concurrency c: c prefills at the matmul rate, then osl-1 decode steps at their floor."""
    prefill = c * prefill_flops(s, isl, 1) / roof.matmul
    decode = (osl - 1) * decode_floor(s, roof, c, isl + osl / 2)
    return c * osl / (prefill + decode)


# ---- (g) roofline ---------------------------------------------------------------------------------------------
def measure_roofline(device: torch.device, dtype: torch.dtype, quick: bool) -> Roofline:
    cuda = device.type == "cuda"
    n = (1 << 30 if quick else 2 << 30) if cuda else 1 << 26
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = statistics.median(time_calls(lambda: dst.copy_(src), device, 10 if cuda else 3))
    del src, dst
    m = 8192 if cuda else 512
    a, b = (torch.randn(m, m, dtype=dtype, device=device) for _ in range(2))
    gemm = statistics.median(time_calls(lambda: a @ b, device, 20 if cuda else 3))
    return Roofline(2 * n / copy, 2 * m ** 3 / gemm)


# ---- our engine -----------------------------------------------------------------------------------------------
def llm_kwargs(args, device: torch.device) -> dict:
    graphs = args.cuda_graphs if args.cuda_graphs is not None else device.type == "cuda"
    kwargs = dict(load_format="dummy", dtype=args.dtype, attn_backend=args.attn_backend or
                  ("triton" if device.type == "cuda" else "torch"), device=str(device),
                  max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                  max_seq_len=args.max_seq_len, enable_chunked_prefill=True,
                  cuda_graph_config={"enable_padding": True, "max_batch_size": args.max_batch_size} if graphs else None,
                  torch_compile_config={"enable_piecewise_cuda_graph": True} if args.piecewise_graphs else None,
                  multimodal_config={"encoder_cuda_graph": {}} if args.encoder_graphs else None)
    kwargs.update(json.loads(args.llm_args))
    known = {f.name for f in fields(LlmArgs)}
    for name in [k for k, v in kwargs.items() if k not in known]:
        if kwargs.pop(name) is not None:
            print(f"warning: this engine has no LLM argument {name!r} yet; not passed", file=sys.stderr)
    return kwargs


@contextlib.contextmanager
def paused(llm: LLM):
    """Drive llm.engine from this thread: holding the loop's condition keeps the loop thread parked in its wait (it
    touches the engine only after reacquiring it). Leave no request unfinished inside."""
    with llm.loop.wake:
        yield llm.engine


def warm(llm: LLM, prompts: Prompts) -> None:
    """Compile and autotune before anything is timed: image prefill, a small batch, decode."""
    llm.generate([prompts.image(), prompts.image(), prompts.text()], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)


def run_ttft(llm: LLM, prompts: Prompts, work: Workload) -> dict:
    """End to end, split into preprocessing (before the engine sees the request), the engine's time to the first
    token, and the rest (hand-offs to and from the engine thread, output assembly)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    walls, engine, prep = [], [], []
    for _ in range(work.ttft_runs):
        prompt = prompts.image()
        t = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        engine.append(out.metrics.first_token_time - out.metrics.arrival_time)
        prep.append(out.metrics.preprocess_time)
    return {"isl": len(out.prompt_token_ids), "ttft_ms": 1e3 * statistics.median(walls),
            "engine_ttft_ms": 1e3 * statistics.median(engine), "preprocess_ms": 1e3 * statistics.median(prep)}


def decode_steps(llm: LLM, prompts: Prompts, batch: int, tokens: int, around=contextlib.nullcontext) -> list[float]:
    """Wall seconds of each step while all `batch` sequences decode; prefill steps and WARM_STEPS decode steps (a new
    batch size may still allocate or autotune) run first, untimed and outside `around`."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    with paused(llm) as engine:
        seqs = [engine.make_sequence(f"decode-{batch}-{i}-{time.monotonic_ns()}", prompts.text(), params)
                for i in range(batch)]
        for seq in seqs:
            engine.add(seq)
        while any(seq.num_output_tokens == 0 and not seq.is_finished for seq in seqs):
            engine.step()
        for _ in range(WARM_STEPS):
            engine.step()
        times = []
        with around():
            # Only full batches: with chunked prefill the first sequences prefilled are the first to finish.
            while not any(seq.is_finished for seq in seqs):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
        for seq in seqs:
            engine.abort(seq.request_id)  # frees the rest; a no-op for finished ones
    if any(seq.finish_reason == "error" for seq in seqs):
        raise RuntimeError("a step failed; the engine logged why")
    if not times:
        raise ValueError(f"decode_tokens={tokens} leaves no full-batch decode step to time at batch {batch}")
    return times


def run_decode(llm: LLM, prompts: Prompts, work: Workload) -> list[dict]:
    return [{"batch": b, "ms_per_step": 1e3 * statistics.median(decode_steps(llm, prompts, b, work.decode_tokens))}
            for b in work.decode_batches]


@contextlib.contextmanager
def sync_probe(runner, waits: list):
    """Record how long each step waits for the GPU where it reads the sampled tokens back (`runner.read`, or a
    synchronize ahead of `runner.sample` in runners without it): the rest of the step's wall time is host work."""
    name = "read" if hasattr(runner, "read") else "sample"
    original = getattr(runner, name)

    def probed(*a, **k):
        t = time.perf_counter()
        if name == "sample":
            torch.cuda.synchronize()
            waits.append(time.perf_counter() - t)
            return original(*a, **k)
        out = original(*a, **k)
        waits.append(time.perf_counter() - t)
        return out

    setattr(runner, name, probed)
    try:
        yield
    finally:
        setattr(runner, name, original)


def run_host(llm: LLM, prompts: Prompts, work: Workload) -> list[dict]:
    rows = []
    cuda = llm.engine.device.type == "cuda"
    for b in work.decode_batches:
        waits = []
        probe = (lambda: sync_probe(llm.engine.runner, waits)) if cuda else contextlib.nullcontext
        steps = decode_steps(llm, prompts, b, work.decode_tokens, probe)
        host = np.asarray(steps) - (np.asarray(waits[-len(steps):]) if waits else 0.0)
        row = {"batch": b, "wall_ms": 1e3 * statistics.median(steps), "host_ms": 1e3 * float(np.median(host))}
        if cuda:
            timer = KernelTimer()
            n = len(decode_steps(llm, prompts, b, work.decode_tokens, lambda: timer))
            row["gpu_ms"] = 1e3 * timer.seconds / n
        rows.append(row)
    return rows


def encode_items(engine, items) -> None:
    engine.encoder.encode(items)
    engine.encoder.cache.clear()  # so the next call encodes again


def run_vit(llm: LLM, prompts: Prompts, work: Workload) -> list[dict]:
    """Encode latency per image count; graphs on and off in one run where the encoder runner has a `use_graphs`
    switch, else as configured (--encoder-graphs)."""
    encoder = llm.engine.encoder
    modes = [True, False] if hasattr(encoder, "use_graphs") else [None]
    rows = []
    for graphs, n in itertools.product(modes, work.vit_images):
        items = [llm.engine.processor(prompts.image()).mm_items[0] for _ in range(n)]
        with paused(llm) as engine, switched(encoder, "use_graphs", graphs):
            # Wall time between syncs rather than events: it is the latency a request sees, host work included,
            # and stays right if the encoder moves to its own stream.
            times = time_calls(lambda: encode_items(engine, items), engine.device, work.vit_iters, 3, events=False)
        rows.append({"images": n, "graphs": graphs, "p50_ms": 1e3 * percentile(times, 50),
                     "p99_ms": 1e3 * percentile(times, 99)})
    return rows


@contextlib.contextmanager
def switched(obj, name: str, value):
    """Set obj.name to value inside the block (nothing when value is None)."""
    if value is None:
        yield
        return
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


def run_capped(llm: LLM, seqs: list, cap: int) -> list:
    """Keep at most `cap` requests in flight: each finished request submits the next, from the loop thread."""
    queue, done, finished = deque(seqs), [], threading.Event()
    first = [queue.popleft() for _ in range(min(cap, len(seqs)))]

    def collect(out):
        if not out.finished:
            return
        done.append(out)
        if queue:
            llm.loop.submit(queue.popleft(), collect)
        if len(done) == len(seqs):
            finished.set()

    for seq in first:
        llm.loop.submit(seq, collect)
    if not finished.wait(CAPPED_TIMEOUT_S):
        raise TimeoutError(f"{len(done)} of {len(seqs)} requests finished in {CAPPED_TIMEOUT_S}s")
    failed = [o for o in done if o.error]
    if failed:
        raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
    return done


def run_throughput_point(llm: LLM, prompts: Prompts, work: Workload, c: int, osl: int) -> dict:
    params = SamplingParams(max_tokens=osl, ignore_eos=True)
    batch = [prompts.image() for _ in range(c * work.rounds)]
    # Preprocessing (the HF processor) is done before the clock starts, as for the HF baseline.
    seqs = [group[0] for group in llm.pool.map(lambda p: llm.prepare(p, params), batch)]
    t = time.perf_counter()
    outs = run_capped(llm, seqs, c)
    seconds = time.perf_counter() - t
    metrics = [o.metrics for o in outs]
    return {"c": c, "osl": osl, "requests": len(outs), "isl": statistics.mean(len(o.prompt_token_ids) for o in outs),
            "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
            "ttft_ms": 1e3 * statistics.median(m.first_token_time - m.arrival_time for m in metrics),
            "tpot_ms": 1e3 * statistics.median((m.finished_time - m.first_token_time) / max(osl - 1, 1)
                                               for m in metrics)}


def run_throughput(llm: LLM, prompts: Prompts, work: Workload) -> list[dict]:
    return [run_throughput_point(llm, prompts, work, c, osl) for osl in work.osl for c in work.concurrency]


# ---- (f) HF transformers --------------------------------------------------------------------------------------
def hf_build(model_dir, device: torch.device, dtype: torch.dtype):
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="sdpa")
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    return model.eval(), processor


def hf_inputs(processor, prompts: list[dict], device: torch.device):
    if "prompt_token_ids" in prompts[0]:
        ids = torch.tensor([p["prompt_token_ids"] for p in prompts])
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    images = [p["multi_modal_data"]["image"][0] for p in prompts]
    return processor(text=[p["prompt"] for p in prompts], images=images, padding=True, return_tensors="pt").to(device)


def hf_generate(model, processor, inputs, n: int) -> None:
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=processor.tokenizer.pad_token_id)


def run_hf(model_dir, prompts: Prompts, work: Workload, device: torch.device, dtype: torch.dtype) -> dict:
    model, processor = hf_build(model_dir, device, dtype)

    def gen(ps: list[dict], n: int) -> None:
        hf_generate(model, processor, hf_inputs(processor, ps, device), n)

    gen([prompts.image()], 2)  # warm-up
    images = [prompts.image() for _ in range(work.ttft_runs)]
    ttft = statistics.median(wall(lambda p=p: gen([p], 1), device) for p in images)
    text = [prompts.text()]
    n = work.decode_tokens
    decode = statistics.median((wall(lambda: gen(text, n + 1), device) - wall(lambda: gen(text, 1), device)) / n
                               for _ in range(2))
    c, osl = max(work.concurrency), min(work.osl)
    inputs = hf_inputs(processor, [prompts.image() for _ in range(c)], device)
    seconds = wall(lambda: hf_generate(model, processor, inputs, osl), device)
    del model, inputs
    free_memory()
    return {"ttft_ms": 1e3 * ttft, "decode_ms_per_step": 1e3 * decode, "c": c, "osl": osl, "tok_s": c * osl / seconds}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- report ---------------------------------------------------------------------------------------------------
def fmt(x, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3g}{unit}" if abs(x) < 100 else f"{x:.0f}{unit}"


def efficiency(ours, floor, time_like: bool) -> str:
    if ours is None or floor is None:
        return "-"
    return f"{100 * (floor / ours if time_like else ours / floor):.0f}%"


def ok(r: dict, key: str, default):
    """A section's result, or `default` where it did not run or failed."""
    value = r.get(key, default)
    return default if isinstance(value, dict) and "error" in value else value


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def latency_rows(r: dict, hf: dict, floor, work: Workload) -> list[tuple]:
    rows = []
    t = ok(r, "ttft", None)
    if t:
        fl = ms(floor(prefill_floor, t["isl"], 1))
        ours = f"{fmt(t['ttft_ms'])} (engine {fmt(t['engine_ttft_ms'])}, preprocess {fmt(t.get('preprocess_ms'))})"
        rows.append((f"(a) TTFT c=1, ISL {t['isl']} (1 img), ms", ours, fmt(hf.get("ttft_ms")), fmt(fl),
                     efficiency(t["ttft_ms"], fl, True)))
    for d in ok(r, "decode", []):
        fl = ms(floor(decode_floor, d["batch"], work.isl + work.decode_tokens / 2))
        peer = fmt(hf.get("decode_ms_per_step")) if d["batch"] == 1 else ""
        rows.append((f"(b) decode ms/step, batch {d['batch']}", fmt(d["ms_per_step"]), peer, fmt(fl),
                     efficiency(d["ms_per_step"], fl, True)))
    return rows


def other_rows(r: dict, hf: dict, floor) -> list[tuple]:
    rows = []
    for p in ok(r, "throughput", []):
        fl = floor(throughput_floor, p["c"], round(p["isl"]), p["osl"])
        peer = fmt(hf["tok_s"]) if (hf.get("c"), hf.get("osl")) == (p["c"], p["osl"]) else ""
        rows.append((f"(c) tok/s c={p['c']} OSL {p['osl']}", fmt(p["tok_s"]), peer, fmt(fl),
                     efficiency(p["tok_s"], fl, False)))
    for v in ok(r, "vit", []):
        graphs = {True: ", graphs on", False: ", graphs off", None: ""}[v["graphs"]]
        rows.append((f"(d) ViT encode {v['images']} img{graphs} p50/p99 ms", f"{fmt(v['p50_ms'])}/{fmt(v['p99_ms'])}",
                     "", "", ""))
    for h in ok(r, "host", []):
        rows.append((f"(e) decode batch {h['batch']}: host/GPU/wall ms",
                     f"{fmt(h['host_ms'])}/{fmt(h.get('gpu_ms'))}/{fmt(h['wall_ms'])}", "", "", ""))
    rows += [(f"{key} FAILED", v["error"][:120].replace("|", "/"), "", "", "") for key, v in r.items()
             if isinstance(v, dict) and "error" in v]
    return rows


def table(r: dict, s: ModelStats, roof: Roofline | None, work: Workload) -> str:
    """One row per figure: ours, HF in the same run, the floor, and ours as a share of the floor."""
    hf = ok(r, "hf", None) or {}
    floor = (lambda f, *a: f(s, roof, *a)) if roof else (lambda *a: None)
    rows = [("(g) measured copy bandwidth, bf16 matmul",
             f"{roof.bandwidth / 1e12:.3g} TB/s, {roof.matmul / 1e12:.3g} TFLOP/s", "", "", "")] if roof else []
    rows += latency_rows(r, hf, floor, work) + other_rows(r, hf, floor)
    lines = ["| figure | ours | HF | floor | ours vs floor |", "|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])


def git(*a) -> str:
    try:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the machine
        return ""


def commit() -> str:
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "nogit"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def device_name(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return "-".join(name.lower().split())


def save(out_dir: pathlib.Path, stem: str, markdown: str, data: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(markdown + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {out_dir / stem}.md and .json")


# ---- main -----------------------------------------------------------------------------------------------------
def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_vl_8b", choices=[*SHAPES, "tiny"])
    p.add_argument("--model-dir", type=pathlib.Path, help="an existing config-only directory (default: written)")
    p.add_argument("--sections", default="abcdefg", help="any of a-g, commas optional")
    p.add_argument("--quick", action="store_true", help="few points and short runs: a smoke test")
    p.add_argument("--out", type=pathlib.Path, default=REPO / "perf" / "results")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attn-backend", help="default: triton on CUDA, torch on CPU")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, help="decode graphs (default: on CUDA)")
    p.add_argument("--piecewise-graphs", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--encoder-graphs", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--llm-args", default="{}", help="JSON of further LLM arguments")
    p.add_argument("--commit", help="commit to record where the tree has no .git (default: git rev-parse)")
    return p.parse_args(argv)


def model_dir_for(args, tmp: str) -> pathlib.Path:
    if args.model_dir:
        return args.model_dir
    if args.model == "tiny":
        return tiny.make_tiny("qwen3_vl", pathlib.Path(tmp) / "tiny")
    return make_shape_dir(args.model, pathlib.Path(tmp) / args.model)


def workload(args) -> Workload:
    work = Workload()
    if args.quick:
        work = replace(work, **QUICK)
    if args.model == "tiny":
        work = replace(work, **TINY)
    return replace(work, decode_batches=tuple(b for b in work.decode_batches if b <= args.max_batch_size),
                   concurrency=tuple(c for c in work.concurrency if c <= args.max_batch_size))


def run_engine_sections(args, model_dir, prompts: Prompts, work: Workload, sections: set, results: dict) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        llm = LLM(model_dir, **llm_kwargs(args, device))
    except Exception as e:  # noqa: BLE001 - the HF and roofline results are still worth saving
        results["engine"] = failure("engine", e)
        return
    with llm:
        warmed = guarded("warm-up", lambda: warm(llm, prompts))
        if warmed is not None:
            results["warm-up"] = warmed
            return
        steps = {"a": ("ttft", run_ttft), "b": ("decode", run_decode), "e": ("host", run_host),
                 "d": ("vit", run_vit), "c": ("throughput", run_throughput)}
        for section in SECTION_ORDER:
            if section in sections and section in steps:
                key, fn = steps[section]
                results[key] = guarded(section, lambda: fn(llm, prompts, work))


def failure(section: str, e: Exception) -> dict:
    print(f"({section}) FAILED:", file=sys.stderr)
    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {e}"}


def guarded(section: str, fn):
    """Run one section; a failure is printed and recorded, and the other sections still run (device time is
    short). The table skips what failed."""
    t = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001
        result = failure(section, e)
    free_memory()
    print(f"({section}) {time.perf_counter() - t:.1f}s {json.dumps(result)}", flush=True)
    return result


def main(argv=None) -> None:
    args = parse(argv)
    sections = set(args.sections.replace(",", ""))
    if not sections <= set(SECTION_ORDER):
        raise SystemExit(f"unknown sections {sorted(sections - set(SECTION_ORDER))}; use a-g")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    work = workload(args)
    results: dict = {"meta": {"model": args.model, "device": device_name(device), "commit": args.commit or commit(),
                              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                              "transformers": transformers.__version__, "quick": args.quick,
                              "workload": asdict(work), "args": {k: str(v) for k, v in vars(args).items()}}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for(args, tmp)
        prompts = Prompts(model_dir, work)
        stats = model_stats(model_dir, prompts, dtype)
        results["model_stats"] = asdict(stats)
        roof = measure_roofline(device, dtype, args.quick) if "g" in sections else None
        results["roofline"] = asdict(roof) if roof else None
        free_memory()
        if "f" in sections:
            results["hf"] = guarded("f", lambda: run_hf(model_dir, prompts, work, device, dtype))
        if sections & set("abcde"):
            run_engine_sections(args, model_dir, prompts, work, sections, results)
    report(args, results, stats, roof, work, device)


def report(args, results: dict, stats: ModelStats, roof: Roofline | None, work: Workload, device) -> None:
    meta = results["meta"]
    graphs = args.cuda_graphs if args.cuda_graphs is not None else device.type == "cuda"
    onoff = {True: "on", False: "off"}
    cpu_note = "; on CPU the floors mean little (bf16 GEMM is emulated)" if device.type == "cpu" else ""
    markdown = (f"# bench_engine {args.model} on {meta['device']}, {meta['date']}, commit {meta['commit']}"
                f"{' (quick)' if args.quick else ''}\n\n"
                f"{stats.params / 1e9:.2f}B params, {args.dtype}, ISL {work.isl} with one {work.image_size}px image "
                f"({stats.image_tokens} tokens); decode graphs {onoff[graphs]}, piecewise prefill graphs "
                f"{onoff[bool(args.piecewise_graphs)]}, encoder graphs {onoff[bool(args.encoder_graphs)]}{cpu_note}"
                f"\n\n{table(results, stats, roof, work)}")
    stem = "_".join(["bench_engine", args.model, meta["date"], meta["device"], meta["commit"]]
                    + (["quick"] if args.quick else []))
    save(args.out, stem, markdown, results)
    print(markdown)


if __name__ == "__main__":
    main()
