"""ViT attention backends at the vision towers' shapes (bf16, 16 heads; head dims 72 for Qwen3-VL, 80 for
Qwen2.5-VL, whose windows are 64 patches): our Triton varlen kernel (what `kernels.vit_attention` runs on Hopper)
and torch's varlen attention (FA2) against SDPA's flash, cuDNN and memory-efficient backends on equal-length
segments batched as (segments, heads, length, dim). Each call is timed as a CUDA graph replay; the error is against
SDPA's math backend in fp32.

    python3 perf/bench_vit_attention.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

from bench_skinny_gemm import graph_ms
from trtllm_qwenvl.kernels.varlen_attention import varlen_attention

SHAPES = [(1, 1024, 72), (8, 1024, 72), (1, 4096, 72), (1, 1024, 80), (16, 64, 80), (64, 64, 80),
          (1, 1024, 128)]  # segments, length, dim
HEADS = 16
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def replay_us(fn) -> float:
    return 1e3 * graph_ms(fn, reps=50)


def sdpa(backend, q, k, v):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v)


def row(segments: int, length: int, dim: int) -> dict[str, str]:
    tokens = segments * length
    q, k, v = (torch.randn(tokens, HEADS, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, tokens + 1, length, device="cuda", dtype=torch.int32)
    batched = [t.view(segments, length, HEADS, dim).transpose(1, 2) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        exact = F.scaled_dot_product_attention(*(t.float() for t in batched))
    scale = dim ** -0.5
    ours = varlen_attention(q, k, v, cu, length, scale).view(segments, length, HEADS, dim).transpose(1, 2)
    out = {"triton": f"{replay_us(lambda: varlen_attention(q, k, v, cu, length, scale)):.1f} "
                     f"(err {(ours.float() - exact).abs().max().item():.1e})",
           "varlen": f"{replay_us(lambda: varlen_attn(q, k, v, cu, cu, length, length)):.1f}"}
    for name, backend in BACKENDS.items():
        try:
            err = (sdpa(backend, *batched).float() - exact).abs().max().item()
            out[name] = f"{replay_us(lambda b=backend: sdpa(b, *batched)):.1f} (err {err:.1e})"
        except RuntimeError as e:  # a backend that does not take this shape
            out[name] = f"n/a: {str(e).splitlines()[0][:60]}"
    return out


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    names = ["triton", "varlen", *BACKENDS]
    print("| segments x length, head dim (GFLOP) | " + " | ".join(f"{b} us" for b in names) + " |")
    print("|---|" + "---|" * (2 + len(BACKENDS)))
    for segments, length, dim in SHAPES:
        gflop = 4 * segments * length ** 2 * HEADS * dim / 1e9
        print(f"| {segments} x {length}, {dim} ({gflop:.1f}) | " + " | ".join(row(segments, length, dim).values())
              + " |")


if __name__ == "__main__":
    main()
