"""Times each Triton kernel against its torch reference at Qwen-VL shapes and prints a markdown table.

Method (device/METHOD.md): CUDA events around each call, warm-up first (compilation stays out), the median of many
repetitions; working sets larger than L2 where the shape allows. The roofline is measured in the same run: a large
device-to-device copy (bytes read + written) and a large bf16 matrix product. "floor" is the larger of bytes over
the copy bandwidth and FLOPs over the matmul rate; "of floor" is floor / measured time for the Triton kernel.

Usage: python3 integration/gpu/bench_kernels.py [--out DIR]
"""
import argparse
import json
import pathlib
import statistics

import torch
import triton

from trtllm_qwenvl.kernels.mrope import apply_mrope
from trtllm_qwenvl.kernels.paged_decode import paged_decode_attention
from trtllm_qwenvl.kernels.pos_embed import interpolated_pos_embed
from trtllm_qwenvl.kernels.qk_rope_store import qk_rope_store
from trtllm_qwenvl.kernels.silu_mul import silu_mul
from trtllm_qwenvl.kernels.vision_rotary import apply_vision_rotary
from trtllm_qwenvl.kernels.vit_attention import fused_path, vit_attention
from trtllm_qwenvl.layers.attention_backends import TorchPagedAttention, TritonPagedAttention
from trtllm_qwenvl.layers.linear import silu_and_mul
from trtllm_qwenvl.layers.rotary import MRotaryEmbedding, VisionRotaryTable, apply_rotary
from trtllm_qwenvl.layers.vision_attention import Segments, varlen_attention_reference
from trtllm_qwenvl.models.qwen3_vl import bilinear_taps
from trtllm_qwenvl.models.vision_common import merge_order_hw
from trtllm_qwenvl.utils.h2d import async_tensor_h2d

from test_kernels import PagedBatch, identity_prologue, prologue_inputs

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 32  # Qwen3-VL-8B attention, the engine's default page


def time_ms(fn, reps: int = 40, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_roofline() -> dict:
    src = torch.randn(256 * 2 ** 20, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), reps=20)
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    mm_ms = time_ms(lambda: a @ b, reps=20)
    return {"copy_GBps": 2 * src.numel() * 4 / copy_ms / 1e6, "mm_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


# ---- paged attention ---------------------------------------------------------------------------------------------

def paged_step(specs: list[tuple[int, int]], seed: int = 0):
    """(cached context, new tokens) per sequence -> q, k, v, caches, metadata and a no-op prologue, pages scattered
    (the GPU suite's fixture, at the Qwen3-VL-8B attention shape in bf16)."""
    b = PagedBatch(specs, HEADS, KV_HEADS, HEAD_DIM, PAGE, BF16, seed)
    return b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, identity_prologue(b)


def attention_bytes_flops(specs) -> tuple[float, float]:
    kv_row = KV_HEADS * HEAD_DIM * 2
    q_row = HEADS * HEAD_DIM * 2
    n_tok = sum(n for _, n in specs)
    byts = sum(c + n for c, n in specs) * 2 * kv_row + n_tok * (2 * q_row + 2 * kv_row)
    visible = sum(n * c + n * (n + 1) / 2 for c, n in specs)
    return byts, 4 * visible * HEADS * HEAD_DIM


def bench_backend(name: str, specs) -> dict:
    q, k, v, k_cache, v_cache, meta, prologue = paged_step(specs)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    times = {}
    for backend in (TorchPagedAttention, TritonPagedAttention):
        meta.plan = backend.plan(meta)
        times[backend.name] = time_ms(
            lambda: backend.forward(q, k, v, prologue, k_cache, v_cache, out, scale, meta))
    byts, flops = attention_bytes_flops(specs)
    return {"kernel": name, "torch": times["torch"], "triton": times["triton"], "bytes": byts, "flops": flops}


def bench_decode_splits(length: int) -> list[dict]:
    q, k, v, k_cache, v_cache, meta, _ = paged_step([(length - 1, 1)])
    out = torch.empty_like(q)
    byts, flops = attention_bytes_flops([(length - 1, 1)])
    rows = []
    for splits in (1, 4, 8, 16, 32):
        ms = time_ms(lambda: paged_decode_attention(q, k_cache, v_cache, out, HEAD_DIM ** -0.5, meta.seq_lens_k,
                                                    meta.block_tables, splits))
        rows.append({"kernel": f"decode attn only, B=1 L={length}, splits={splits}", "torch": None, "triton": ms,
                     "bytes": byts, "flops": flops})
    return rows


# ---- small kernels -----------------------------------------------------------------------------------------------

def bench_prologue(n: int) -> dict:
    """q/k norm + rotary + K/V store at the Qwen3-VL-8B attention shape: the torch path against the fused kernel."""
    q, k, v, p = prologue_inputs("qwen3_vl", n, BF16, seed=0)
    k_cache = torch.randn(triton.cdiv(n, PAGE) + 1, PAGE, KV_HEADS, HEAD_DIM, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.arange(n, device=DEV)
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)

    def reference():
        q_rot, k_rot = p.apply(q, k)
        flat_k.index_copy_(0, slots, k_rot)
        flat_v.index_copy_(0, slots, v)

    return {"kernel": f"q/k norm + rotary + kv store, N={n}", "torch": time_ms(reference),
            "triton": time_ms(lambda: qk_rope_store(q, k, v, p.cos, p.sin, p.q_norm, p.k_norm, p.eps, p.norm,
                                                    k_cache, v_cache, slots)),
            "bytes": 2 * (2 * q.numel() + 2 * k.numel() + 2 * v.numel()) + n * 8, "flops": 0}


def bench_silu_mul(n: int, features: int = 12288) -> dict:
    """The gated MLP's activation after cuBLAS (Qwen3-VL-8B's intermediate size): the eager torch reference (two
    kernels) against ours."""
    gate_up = torch.randn(n, 2 * features, device=DEV, dtype=BF16)
    return {"kernel": f"silu(gate) * up, {n} x {features}", "torch": time_ms(lambda: silu_and_mul(gate_up)),
            "triton": time_ms(lambda: silu_mul(gate_up)), "bytes": 3 * n * features * 2, "flops": 0}


def bench_mrope(n: int, interleaved: bool) -> dict:
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    rope = MRotaryEmbedding(HEAD_DIM, 32768, 5e6, section, interleaved).to(DEV)
    positions = torch.randint(0, 32768, (3, n), device=DEV)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEV, dtype=BF16)
    q = qkv[:, :HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)

    def reference():  # TextModel computes cos/sin once per forward; each layer then rotates q and k
        cos, sin = rope(positions)
        cos, sin = cos.to(BF16), sin.to(BF16)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    name = f"mrope {'interleaved' if interleaved else 'sectioned'} q+k, N={n}"
    return {"kernel": name, "torch": time_ms(reference),
            "triton": time_ms(lambda: apply_mrope(q, k, positions, rope.cos_table, rope.sin_table, rope.axes)),
            "bytes": 2 * (q.numel() + k.numel()) * 2 + 3 * n * 8, "flops": 0}


def bench_vision_rotary(s: int, head_dim: int, heads: int = 16) -> dict:
    table = VisionRotaryTable(head_dim).to(DEV)
    cos, sin = table(torch.randint(0, 128, (s, 2), device=DEV))
    qkv = torch.randn(s, 3, heads, head_dim, device=DEV, dtype=BF16)
    q, k, _ = qkv.unbind(1)

    def reference():
        return apply_rotary(q.float(), cos, sin).to(BF16), apply_rotary(k.float(), cos, sin).to(BF16)

    return {"kernel": f"vision rotary q+k, S={s} H={heads} D={head_dim}", "torch": time_ms(reference),
            "triton": time_ms(lambda: apply_vision_rotary(q, k, cos, sin)),
            "bytes": 2 * 2 * q.numel() * 2 + 2 * cos.numel() * 4, "flops": 0}


def bench_pos_embed(grid, side: int = 48, dim: int = 1152, merge: int = 2) -> dict:
    table = torch.randn(side * side, dim, device=DEV, dtype=BF16)
    t, h, w = grid

    def reference():  # Qwen3VisionTower.build_grid's pos path, host index math and H2D included
        index, weight = bilinear_taps(merge_order_hw(h, w, merge), h, w, side)
        taps = table[async_tensor_h2d(index, torch.long, DEV)]
        pos = (taps * async_tensor_h2d(weight, torch.float32, DEV)[:, :, None]).sum(1)
        return pos.to(BF16).repeat(t, 1)

    return {"kernel": f"qwen3 pos-embed bilinear+merge, grid={grid}", "torch": time_ms(reference),
            "triton": time_ms(lambda: interpolated_pos_embed(table, grid, merge)),
            "bytes": t * h * w * dim * 2 + side * side * dim * 2, "flops": 0}


def bench_vit_attention(lengths: list[int], head_dim: int, heads: int = 16) -> dict:
    s = sum(lengths)
    qkv = torch.randn(s, 3, heads, head_dim, device=DEV, dtype=BF16)
    q, k, v = qkv.unbind(1)
    segments = Segments.build(lengths, DEV)
    scale = head_dim ** -0.5
    flops = 4 * sum(n * n for n in lengths) * heads * head_dim
    name = f"vit attention ({fused_path(q) or 'sdpa'}), {len(lengths)}x{lengths[0]} D={head_dim}"
    return {"kernel": name, "torch": time_ms(lambda: varlen_attention_reference(q, k, v, segments, scale)),
            "triton": time_ms(lambda: vit_attention(q, k, v, segments, scale)),
            "bytes": 4 * q.numel() * 2, "flops": flops}


# ---- report ------------------------------------------------------------------------------------------------------

def row_text(r: dict, roof: dict) -> str:
    floor = max(r["bytes"] / roof["copy_GBps"] / 1e6, r["flops"] / roof["mm_TFLOPs"] / 1e9)
    ms = r["triton"]
    torch_ms = f"{r['torch']:.4f}" if r["torch"] is not None else "-"
    speedup = f"{r['torch'] / ms:.1f}x" if r["torch"] is not None else "-"
    rate = f"{r['bytes'] / ms / 1e6:.0f} GB/s"
    if r["flops"]:
        rate += f", {r['flops'] / ms / 1e9:.0f} TFLOP/s"
    return f"| {r['kernel']} | {torch_ms} | {ms:.4f} | {speedup} | {rate} | {floor:.4f} | {100 * floor / ms:.0f}% |"


def cases():
    yield lambda: bench_backend("decode store+attn, B=1 L=32768", [(32767, 1)])
    yield lambda: bench_backend("decode store+attn, B=8 L=4096", [(4095, 1)] * 8)
    yield lambda: bench_backend("decode store+attn, B=32 L=2048", [(2047, 1)] * 32)
    yield lambda: bench_backend("decode store+attn, B=128 L=1024", [(1023, 1)] * 128)
    yield lambda: bench_decode_splits(32768)
    yield lambda: bench_backend("prefill store+attn, 1x4096 new", [(0, 4096)])
    yield lambda: bench_backend("prefill store+attn, 4x1024 chunk on 3072 cached", [(3072, 1024)] * 4)
    yield lambda: bench_backend("mixed store+attn, 1x2048 new + 64 decodes L=1024", [(0, 2048)] + [(1023, 1)] * 64)
    yield lambda: bench_prologue(8192)
    yield lambda: bench_prologue(1)
    yield lambda: bench_silu_mul(1024)
    yield lambda: bench_silu_mul(8192)
    yield lambda: bench_mrope(8192, interleaved=True)
    yield lambda: bench_mrope(8192, interleaved=False)
    yield lambda: bench_vision_rotary(16384, 72)
    yield lambda: bench_vision_rotary(16384, 80)
    yield lambda: bench_pos_embed((1, 128, 128))
    yield lambda: bench_pos_embed((4, 64, 64))
    yield lambda: bench_vit_attention([1024] * 8, 72)
    yield lambda: bench_vit_attention([64] * 128, 80)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    out_dir = pathlib.Path(parser.parse_args().out)
    roof = measure_roofline()
    rows, lines = [], []
    for case in cases():
        try:
            result = case()
        except Exception as exc:  # one broken case must not cost the rest of the device call
            lines.append(f"| error: {type(exc).__name__}: {str(exc)[:150]} | | | | | | |")
            continue
        for r in result if isinstance(result, list) else [result]:
            rows.append(r)
            lines.append(row_text(r, roof))
    head = (f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n"
            f"roofline: copy {roof['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {roof['mm_TFLOPs']:.0f} TFLOP/s\n\n"
            "| kernel (bf16, Qwen3-VL-8B attention: 32 q / 8 kv heads, d=128, page 32) | torch ms | triton ms "
            "| speedup | triton rate | floor ms | of floor |\n|---|---|---|---|---|---|---|")
    table = "\n".join([head] + lines)
    (out_dir / "bench_kernels.md").write_text(table + "\n")
    (out_dir / "bench_kernels.json").write_text(json.dumps({"roofline": roof, "rows": rows}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
