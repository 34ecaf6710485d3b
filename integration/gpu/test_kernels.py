"""Each Triton kernel against its torch reference (the code the CPU path runs) and a float64 reference.

Runs on a CUDA GPU; on CPU it skips, unless TRITON_INTERPRET=1, which runs the small cases in Triton's interpreter.
Error is ||out - ref|| / ||ref||; outputs are poisoned with NaN first, so an unwritten element fails.
"""
import os

import numpy as np
import pytest
import torch

import triton

from trtllm_qwenvl.kernels.mrope import apply_mrope
from trtllm_qwenvl.kernels.paged_decode import MAX_SPLITS, WORKSPACE, paged_decode_attention
from trtllm_qwenvl.kernels import paged_prefill
from trtllm_qwenvl.kernels.paged_prefill import paged_prefill_attention
from trtllm_qwenvl.kernels.patch_rows import patch_rows
from trtllm_qwenvl.kernels.pos_embed import interpolated_pos_embed
from trtllm_qwenvl.kernels.qk_rope_store import qk_rope_store
from trtllm_qwenvl.kernels.silu_mul import silu_mul
from trtllm_qwenvl.kernels.skinny_gemm import MAX_ROWS, Config, skinny_gemm, skinny_gemm_normed
from trtllm_qwenvl.kernels.varlen_attention import varlen_attention
from trtllm_qwenvl.kernels.vision_rotary import apply_vision_rotary
from trtllm_qwenvl.kernels.vit_attention import fused_path, vit_attention
from trtllm_qwenvl.layers.attention_backends import Prologue, TorchPagedAttention, TritonPagedAttention
from trtllm_qwenvl.layers.forward_context import AttentionMetadata
from trtllm_qwenvl.layers.linear import linear_op, normed_linear_op, silu_and_mul
from trtllm_qwenvl.layers.mlp import MLP
from trtllm_qwenvl.layers.norm import ADD_NORMS, LayerNorm
from trtllm_qwenvl.layers.rotary import MRotaryEmbedding, VisionRotaryTable, apply_rotary
from trtllm_qwenvl.layers.vision_attention import Segments, varlen_attention_reference
from trtllm_qwenvl.inputs.pixels import PixelNorm
from trtllm_qwenvl.models.qwen3_vl import bilinear_taps
from trtllm_qwenvl.models.vision_common import merge_order_hw

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="CUDA only (too large or CUDA-specific for the interpreter)")
BF16_TOL, FP32_TOL = 1e-2, 1e-4
# The interpreter truncates fp32 -> bf16 instead of rounding, so it checks fp32 only.
DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tol(dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


# ---- paged KV fixtures -------------------------------------------------------------------------------------------

class PagedBatch:
    """A random batch over a random paged cache: per sequence (cached context, new query tokens)."""

    def __init__(self, specs, num_heads, kv_heads, head_dim, page, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        gd = torch.Generator(device=DEVICE).manual_seed(seed)
        self.specs, self.page, self.dtype = specs, page, dtype
        lens_k = [c + n for c, n in specs]
        blocks_per = [triton.cdiv(max(n, 1), page) for n in lens_k]
        num_blocks = sum(blocks_per) + 3
        perm = torch.randperm(num_blocks, generator=g)  # pages scattered through the pool
        max_blocks = max(blocks_per)
        tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
        slots, at = [], 0
        for i, (ctx, n) in enumerate(specs):
            tables[i, :blocks_per[i]] = perm[at:at + blocks_per[i]].int()
            at += blocks_per[i]
            pos = torch.arange(ctx, ctx + n)
            slots.append(tables[i, pos // page].long() * page + pos % page)
        n_tok = sum(n for _, n in specs)
        shape = (num_blocks, page, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gd, device=DEVICE).to(dtype)
        self.v_cache = torch.randn(shape, generator=gd, device=DEVICE).to(dtype)
        # q, k, v as views of one fused projection, as the attention layer produces them
        qkv = torch.randn(n_tok, (num_heads + 2 * kv_heads) * head_dim, generator=gd, device=DEVICE).to(dtype)
        q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        self.q = q.view(n_tok, num_heads, head_dim)
        self.k = k.view(n_tok, kv_heads, head_dim)
        self.v = v.reshape(n_tok, kv_heads, head_dim)
        q_lens = [n for _, n in specs]
        cu = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
        self.meta = AttentionMetadata(
            cu_seqlens_q=torch.from_numpy(cu).to(DEVICE),
            seq_lens_k=torch.tensor(lens_k, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE),
            slot_mapping=torch.cat(slots).to(DEVICE),
            token_seq=torch.repeat_interleave(torch.arange(len(specs)), torch.tensor(q_lens)).to(DEVICE),
            token_pos=torch.cat([torch.arange(n) for n in q_lens]).to(DEVICE),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(lens_k), block_size=page)

    def store_reference(self):
        """The CPU path's store, so the attention kernels are checked on their own."""
        flat_k = self.k_cache.view(-1, *self.k_cache.shape[-2:])
        flat_v = self.v_cache.view(-1, *self.v_cache.shape[-2:])
        flat_k.index_copy_(0, self.meta.slot_mapping, self.k)
        flat_v.index_copy_(0, self.meta.slot_mapping, self.v)

    def reference64(self, scale: float) -> torch.Tensor:
        """float64 causal attention per sequence over its pages (cache already holds the step's K/V)."""
        out, at = [], 0
        tables = self.meta.block_tables.long()
        group = self.q.shape[1] // self.k_cache.shape[2]
        for i, (ctx, n) in enumerate(self.specs):
            pos = torch.arange(ctx + n, device=DEVICE)
            slots = tables[i, pos // self.page] * self.page + pos % self.page
            k = self.k_cache.view(-1, *self.k_cache.shape[-2:])[slots].double().repeat_interleave(group, 1)
            v = self.v_cache.view(-1, *self.v_cache.shape[-2:])[slots].double().repeat_interleave(group, 1)
            q = self.q[at:at + n].double()
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            visible = pos[None, :] <= (ctx + torch.arange(n, device=DEVICE))[:, None]
            p = s.masked_fill(~visible, float("-inf")).softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", p, v))
            at += n
        return torch.cat(out)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def identity_prologue(b: "PagedBatch") -> Prologue:
    """No norm and a rotation by angle 0: the backends then store and attend over q, k, v exactly as given."""
    n, _, d = b.q.shape
    cos = torch.ones(n, d // 2, device=DEVICE, dtype=b.dtype)
    return Prologue(cos, torch.zeros_like(cos), None, None, 0.0, "none")


# ---- attention prologue: q/k norm + rotary + KV store -----------------------------------------------------------

PROLOGUE_CASES = {
    # (query heads, KV heads, head_dim, rotary half, norm, gated q): Qwen3-VL-8B, Qwen2.5-VL-7B (no norm, group of
    # 7), Qwen3.5 (gated q, zero-centred norm, partial rotary 64 of 256), and an odd small shape
    "qwen3_vl": (32, 8, 128, 64, "rms", False),
    "qwen2_5_vl": (28, 4, 128, 64, "none", False),
    "qwen3_5": (16, 4, 256, 32, "zero_centred", True),
    "odd": (3, 1, 72, 20, "rms", False),
}


def prologue_inputs(case: str, n: int, dtype, seed: int):
    heads, kv_heads, d, half, norm, gated = PROLOGUE_CASES[case]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q_rows = heads * d * (2 if gated else 1)
    qkv = torch.randn(n, q_rows + 2 * kv_heads * d, device=DEVICE, generator=g).to(dtype)
    q, k, v = qkv.split([q_rows, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(n, heads, 2 * d)[..., :d] if gated else q.view(n, heads, d)  # strided views, as the layer passes
    k, v = k.view(n, kv_heads, d), v.view(n, kv_heads, d)
    angles = torch.rand(n, half, device=DEVICE, generator=g) * 6.3
    weights = [torch.randn(d, device=DEVICE, generator=g).to(dtype) * 0.5 + (0 if norm == "zero_centred" else 1)
               for _ in range(2)]
    prologue = Prologue(angles.cos().to(dtype), angles.sin().to(dtype), *weights, 1e-6, norm)
    if norm == "none":
        prologue.q_norm = prologue.k_norm = None
    return q, k, v, prologue


def prologue64(x: torch.Tensor, weight, p: Prologue) -> torch.Tensor:
    x = x.double()
    if p.norm != "none":
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + p.eps)
        x = x * (weight.double() + (1 if p.norm == "zero_centred" else 0))
    half = p.cos.shape[1]
    c, s = p.cos.double()[:, None], p.sin.double()[:, None]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(PROLOGUE_CASES))
@pytest.mark.parametrize("n", [1, 7, 300])
def test_qk_rope_store_matches_torch_prologue(dtype, case, n):
    if INTERPRET and (n == 300 or case == "qwen3_vl"):
        pytest.skip("interpreter: small cases")
    q, k, v, p = prologue_inputs(case, n, dtype, seed=n)
    page, kv_heads, d = 16, k.shape[1], k.shape[2]
    num_blocks = triton.cdiv(n, page) + 2
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:n]
    k_cache = torch.randn(num_blocks, page, kv_heads, d, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    q_out = qk_rope_store(q, k, v, p.cos, p.sin, p.q_norm, p.k_norm, p.eps, p.norm, k_cache, v_cache, slots)
    ref_q, ref_k = p.apply(q, k)  # the torch backend's own prologue
    ref_k_cache.view(-1, kv_heads, d).index_copy_(0, slots, ref_k)
    ref_v_cache.view(-1, kv_heads, d).index_copy_(0, slots, v)
    stored_k = k_cache.view(-1, kv_heads, d)[slots]
    exact_q, exact_k = prologue64(q, p.q_norm, p), prologue64(k, p.k_norm, p)
    err_q, err_k = rel_err(q_out, ref_q), rel_err(stored_k, ref_k)
    err64 = max(rel_err(q_out, exact_q), rel_err(stored_k, exact_k))
    err64_torch = max(rel_err(ref_q, exact_q), rel_err(ref_k, exact_k))
    print(f"qk prologue {case} n={n} {dtype}: vs torch q {err_q:.2e} k {err_k:.2e}; vs float64 {err64:.2e} "
          f"(torch {err64_torch:.2e})")
    assert q_out.is_contiguous()
    assert err_q < (1e-6 if dtype == torch.float32 else 5e-3) and err_k < (1e-6 if dtype == torch.float32 else 5e-3)
    assert err64 <= 1.5 * err64_torch + 1e-6
    assert torch.equal(v_cache, ref_v_cache)
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache.view(-1, kv_heads, d)[untouched], ref_k_cache.view(-1, kv_heads, d)[untouched])


def test_qk_rope_store_skips_negative_slots():
    q, k, v, p = prologue_inputs("odd", 8, torch.float32, seed=1)
    k_cache = torch.randn(4, 16, 1, 72, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.arange(8, device=DEVICE) * 3
    slots[::2] = -1
    q_out = qk_rope_store(q, k, v, p.cos, p.sin, p.q_norm, p.k_norm, p.eps, p.norm, k_cache, v_cache, slots)
    assert rel_err(q_out, p.apply(q, k)[0]) < 1e-6  # padding rows still get their q (attention masks them)
    written = slots[1::2]
    flat_k, flat_v = k_cache.view(-1, 72), v_cache.view(-1, 72)
    assert torch.equal(flat_v[written], v[1::2].reshape(-1, 72))
    keep = torch.ones(64, dtype=torch.bool, device=DEVICE)
    keep[written] = False
    assert torch.equal(flat_k[keep], before_k.view(-1, 72)[keep])
    assert torch.equal(flat_v[keep], before_v.view(-1, 72)[keep])


# ---- prefill -----------------------------------------------------------------------------------------------------

PREFILL_CASES = {
    # (cached context, new tokens) per sequence: fresh prompts, cached prefixes, partial pages, single tokens
    "ragged": [(0, 1), (0, 77), (48, 33), (13, 1), (0, 130), (100, 64)],
    "prefix_hit": [(256, 40), (64, 1), (31, 97)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 32, 64])
# (query heads, KV heads, head_dim): Qwen3-VL-8B, Qwen2.5-VL-7B (group of 7), no GQA, Qwen3.5 (head_dim 256)
@pytest.mark.parametrize("heads", [(32, 8, 128), (28, 4, 128), (4, 4, 128), (16, 4, 256)])
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
@pytest.mark.parametrize("order", ["heavy_first", "position"])
def test_prefill_matches_reference(dtype, page, heads, case, order, monkeypatch):
    if order == "position":  # the launch order of chunks longer than the threshold, here for short ones
        monkeypatch.setattr(paged_prefill, "HEAVY_FIRST_MAX_TOKENS", 0)
    if INTERPRET:
        if heads != (4, 4, 128) or page != 16:
            pytest.skip("interpreter: one small configuration")
        heads = (4, 4, 32)
    head_dim = heads[2]
    b = PagedBatch(PREFILL_CASES[case], *heads, page, dtype, seed=page + heads[0])
    scale = head_dim ** -0.5
    b.store_reference()
    out = poisoned_like(b.q)
    paged_prefill_attention(b.q, b.k_cache, b.v_cache, out, scale, b.meta.cu_seqlens_q, b.meta.seq_lens_k,
                            b.meta.block_tables, b.meta.max_seqlen_q)
    ref = b.reference64(scale)
    err = rel_err(out, ref)
    torch_out = torch.empty_like(b.q)
    TorchPagedAttention.forward(b.q, b.k, b.v, identity_prologue(b), b.k_cache.clone(), b.v_cache.clone(),
                                torch_out, scale, _planned(TorchPagedAttention, b.meta))
    torch_err = rel_err(torch_out, ref)
    print(f"prefill {case} {order} {dtype} page={page} heads={heads}: triton {err:.2e} torch {torch_err:.2e}")
    assert err < tol(dtype)
    assert err <= 2 * torch_err + 1e-6


def _planned(backend, meta: AttentionMetadata) -> AttentionMetadata:
    meta.plan = backend.plan(meta)
    return meta


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_matches_torch_backend(dtype):
    """Mixed step (decodes + prefill chunks): cache contents and outputs of both backends agree."""
    specs = [(300, 1), (0, 200), (17, 1), (64, 129), (1000, 1)]
    b = PagedBatch(specs, 32, 8, 128, 32, dtype, seed=7)
    scale = 128 ** -0.5
    outs, caches = [], []
    for backend in (TorchPagedAttention, TritonPagedAttention):
        kc, vc = b.k_cache.clone(), b.v_cache.clone()
        out = poisoned_like(b.q)
        meta = _planned(backend, AttentionMetadata(**{**vars(b.meta), "plan": {}}))
        backend.forward(b.q, b.k, b.v, identity_prologue(b), kc, vc, out, scale, meta)
        outs.append(out)
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert rel_err(outs[1], outs[0]) < tol(dtype)


# ---- decode ------------------------------------------------------------------------------------------------------

DECODE_CASES = {
    "single_token_contexts": [1, 1, 2],
    "page_edges": [15, 16, 17, 31, 32, 33, 63, 64, 65, 1000],
    "long_32k": [32768, 32001],
    "batch_64": [(i * 397) % 3000 + 1 for i in range(64)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [16, 32, 64])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("splits", [None, 1, 7, MAX_SPLITS])
def test_decode_matches_reference(dtype, page, case, splits):
    if INTERPRET and (case != "page_edges" or page != 16 or splits is None):
        pytest.skip("interpreter: one small configuration")
    if case == "long_32k" and dtype == torch.float32 and page != 64:
        pytest.skip("32k fp32 once is enough")
    heads, head_dim = ((32, 8), 128) if not INTERPRET else ((8, 2), 32)
    b = PagedBatch([(n - 1, 1) for n in DECODE_CASES[case]], *heads, head_dim, page, dtype, seed=page)
    scale = head_dim ** -0.5
    b.store_reference()
    out = poisoned_like(b.q)
    paged_decode_attention(b.q, b.k_cache, b.v_cache, out, scale, b.meta.seq_lens_k, b.meta.block_tables, splits)
    err = rel_err(out, b.reference64(scale))
    print(f"decode {case} {dtype} page={page} splits={splits}: {err:.2e}")
    assert err < tol(dtype)
    assert not WORKSPACE.arrivals.any(), "the last split must reset its counter for the next launch"


@gpu_only
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_head_dim_256(splits):
    b = PagedBatch([(n - 1, 1) for n in DECODE_CASES["page_edges"]], 16, 4, 256, 16, torch.bfloat16, seed=5)
    b.store_reference()
    out = poisoned_like(b.q)
    paged_decode_attention(b.q, b.k_cache, b.v_cache, out, 256 ** -0.5, b.meta.seq_lens_k, b.meta.block_tables,
                           splits)
    err = rel_err(out, b.reference64(256 ** -0.5))
    print(f"decode head_dim=256 splits={splits}: {err:.2e}")
    assert err < BF16_TOL


@gpu_only
def test_decode_empty_sequence_gives_zeros():
    """Padding rows of a captured batch may carry seq_len 0: they must stay finite."""
    b = PagedBatch([(99, 1), (0, 1)], 32, 8, 128, 16, torch.bfloat16, seed=3)
    b.store_reference()
    b.meta.seq_lens_k[1] = 0
    for splits in (1, 8):
        out = poisoned_like(b.q)
        paged_decode_attention(b.q, b.k_cache, b.v_cache, out, 128 ** -0.5, b.meta.seq_lens_k,
                               b.meta.block_tables, splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert not out[0].isnan().any()


@gpu_only
def test_decode_cuda_graph_replays_with_new_inputs():
    """Store + decode captured once through the backend, replayed twice on different inputs and lengths."""
    batch, heads, kv_heads, d, page, max_len = 4, 32, 8, 128, 16, 4096
    scale = d ** -0.5
    first = PagedBatch([(n - 1, 1) for n in (4000, 17, 2048, 700)], heads, kv_heads, d, page, torch.bfloat16, 11)
    static = {name: t.clone() for name, t in (("q", first.q), ("k", first.k), ("v", first.v))}
    max_blocks = max_len // page
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(first.meta.cu_seqlens_q.clone(), first.meta.seq_lens_k.clone(), tables,
                             first.meta.slot_mapping.clone(), first.meta.token_seq, first.meta.token_pos,
                             1, max_len, page)
    num_blocks = batch * max_blocks
    k_cache = torch.randn(num_blocks, page, kv_heads, d, device=DEVICE).bfloat16()
    v_cache = torch.randn_like(k_cache)
    out = torch.empty_like(static["q"])
    meta.plan = TritonPagedAttention.plan(meta)
    assert meta.plan["decode"]
    identity = identity_prologue(first)

    def step():
        TritonPagedAttention.forward(static["q"], static["k"], static["v"], identity, k_cache, v_cache, out, scale,
                                     meta)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, lens in ((21, (3000, 1, 4096, 129)), (22, (16, 2500, 33, 4000))):
        fresh = PagedBatch([(n - 1, 1) for n in lens], heads, kv_heads, d, page, torch.bfloat16, seed)
        # Lay the fresh batch into the captured pool: sequence i owns pages [i*max_blocks, (i+1)*max_blocks).
        for name in ("q", "k", "v"):
            static[name].copy_(getattr(fresh, name))
        fresh_tables = fresh.meta.block_tables.long()
        for i, n in enumerate(lens):
            own = torch.arange(i * max_blocks, (i + 1) * max_blocks, device=DEVICE)
            used = triton.cdiv(n, page)
            k_cache[own[:used]] = fresh.k_cache[fresh_tables[i, :used]]
            v_cache[own[:used]] = fresh.v_cache[fresh_tables[i, :used]]
            tables[i] = own.int()
            pos = n - 1
            meta.slot_mapping[i] = own[pos // page] * page + pos % page
        meta.seq_lens_k.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expected = torch.empty_like(out)
        eager = AttentionMetadata(**{**vars(meta), "plan": {}})
        eager.plan = TorchPagedAttention.plan(eager)
        TorchPagedAttention.forward(static["q"], static["k"], static["v"], identity, k_cache.clone(),
                                    v_cache.clone(), expected, scale, eager)
        err = rel_err(out, expected)
        print(f"graph replay seed={seed}: {err:.2e} vs the torch backend")
        assert err < BF16_TOL


# ---- mRoPE -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["sectioned", "interleaved", "partial"])
def test_mrope_matches_reference(dtype, layout):
    # (rotary_dim, mrope_section, interleaved): Qwen2.5-VL, Qwen3-VL, and a partial rotary over half the head
    rotary_dim, section, interleaved = {"sectioned": (128, [16, 24, 24], False),
                                        "interleaved": (128, [24, 20, 20], True),
                                        "partial": (64, [8, 12, 12], True)}[layout]
    n, heads, kv_heads, d = (777, 32, 8, 128) if not INTERPRET else (5, 4, 2, 128)
    rope = MRotaryEmbedding(rotary_dim, 4096, 1e6, section, interleaved).to(DEVICE)
    g = torch.Generator().manual_seed(len(layout))
    positions = torch.randint(0, 4096, (3, n), generator=g).to(DEVICE)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, :heads * d].view(n, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(n, kv_heads, d)
    cos, sin = rope(positions)
    ref_q, ref_k = apply_rotary(q.double(), cos.double(), sin.double()), apply_rotary(k.double(), cos.double(),
                                                                                      sin.double())
    # the model's torch path: cos/sin cast to the activation dtype
    torch_q = apply_rotary(q, cos.to(dtype), sin.to(dtype))
    out_q, out_k = apply_mrope(q.clone(), k.clone(), positions, rope.cos_table, rope.sin_table, rope.axes)
    err = max(rel_err(out_q, ref_q), rel_err(out_k, ref_k))
    print(f"mrope {layout} {dtype}: triton {err:.2e} torch {rel_err(torch_q, ref_q):.2e}")
    assert err < (1e-6 if dtype == torch.float32 else 5e-3)
    assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])


# ---- vision rotary -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("patch, sizes", [(16, [(64, 96), (64, 96)]), (14, [(56, 84)]), (16, [(32, 128)])])
def test_patch_rows_match_hf_processor(dtype, patch, sizes):
    """Whole uint8 images -> the HF image processor's own pixels (rescaled, normalised, patchified), rounded once to
    `dtype`: bit for bit, so the tower sees what HF's would."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessor
    processor = Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2)
    rng = np.random.default_rng(patch)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    ref = processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")["pixel_values"]
    norm = PixelNorm.of(processor)
    mean, std = (t.to(DEVICE) for t in (norm.mean, norm.std))
    out = patch_rows(torch.from_numpy(np.stack(images)).to(DEVICE), mean, std, patch, 2, 2, dtype)
    assert torch.equal(out.cpu(), ref.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [72, 80])
def test_vision_rotary_matches_reference(dtype, head_dim):
    s, heads = (2000, 16) if not INTERPRET else (6, 2)
    table = VisionRotaryTable(head_dim).to(DEVICE)
    g = torch.Generator().manual_seed(head_dim)
    hw = torch.randint(0, 200, (s, 2), generator=g).to(DEVICE)
    cos, sin = table(hw)
    qkv = torch.randn(s, 3, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q, k, _ = qkv.unbind(1)
    ref_q = apply_rotary(q.float(), cos, sin).to(dtype)  # exactly what VisionAttention does
    ref_k = apply_rotary(k.float(), cos, sin).to(dtype)
    exact_q = apply_rotary(q.double(), cos.double(), sin.double())
    out_q, out_k = apply_vision_rotary(q.clone(), k.clone(), cos, sin)
    err_torch = max(rel_err(out_q, ref_q), rel_err(out_k, ref_k))
    err64 = rel_err(out_q, exact_q)
    print(f"vision rotary d={head_dim} {dtype}: vs torch path {err_torch:.2e}, vs float64 {err64:.2e}")
    assert err_torch < (1e-6 if dtype == torch.float32 else 1e-3)
    assert err64 < (1e-6 if dtype == torch.float32 else 5e-3)


# ---- Qwen3-VL position embeddings --------------------------------------------------------------------------------

def pos_embed_reference(table: torch.Tensor, grid, merge: int, side: int, dtype64: bool) -> torch.Tensor:
    """Qwen3VisionTower.build_grid's computation (host taps, embedding lookup, weighted sum), optionally in fp64."""
    t, h, w = grid
    index, weight = bilinear_taps(merge_order_hw(h, w, merge), h, w, side)
    taps = table[torch.from_numpy(index).to(table.device)]
    weight = torch.from_numpy(weight).to(table.device)
    if dtype64:
        return (taps.double() * weight.double()[:, :, None]).sum(1).repeat(t, 1)
    return (taps * weight[:, :, None]).sum(1).to(table.dtype).repeat(t, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid", [(1, 16, 24), (2, 34, 20), (1, 2, 2), (1, 100, 60), (3, 48, 48)])
def test_pos_embed_matches_reference(dtype, grid):
    side, dim, merge = (48, 1152, 2) if not INTERPRET else (8, 40, 2)
    if INTERPRET and max(grid) > 34:
        pytest.skip("interpreter: small grids")
    g = torch.Generator().manual_seed(sum(grid))
    table = torch.randn(side * side, dim, generator=g).to(dtype).to(DEVICE)
    out = interpolated_pos_embed(table, grid, merge)
    err_torch = rel_err(out, pos_embed_reference(table, grid, merge, side, False))
    err64 = rel_err(out, pos_embed_reference(table, grid, merge, side, True))
    print(f"pos embed {grid} {dtype}: vs torch path {err_torch:.2e}, vs float64 {err64:.2e}")
    assert err_torch < (1e-6 if dtype == torch.float32 else 1e-3)
    assert err64 < (1e-6 if dtype == torch.float32 else 5e-3)


# ---- ViT attention -----------------------------------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [72, 80])
def test_vit_attention_matches_reference(dtype, head_dim):
    lengths = [64, 1, 100, 1024, 37, 256]
    heads = 16
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv.unbind(1)
    segments = Segments.build(lengths, DEVICE)
    scale = head_dim ** -0.5
    out = vit_attention(q, k, v, segments, scale)
    ref = varlen_attention_reference(q.double(), k.double(), v.double(), segments, scale)
    err = rel_err(out, ref)
    print(f"vit attention d={head_dim} {dtype} via {fused_path(q) or 'sdpa'}: {err:.2e}")
    if dtype == torch.bfloat16:
        assert fused_path(q) is not None, "the Triton kernel or torch.nn.attention.varlen should serve bf16"
    assert err < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [72, 80, 64, 128])
@pytest.mark.parametrize("lengths", [[1], [37, 64, 1, 129], [1024, 300, 64]])
def test_varlen_attention_matches_reference(dtype, head_dim, lengths):
    """Odd lengths, a single token, partial tiles, padded head dims; empty trailing segments as the vision graphs
    pad cu_seqlens; both the tower's tiles and the window-sized ones (max_len <= 64)."""
    if INTERPRET and sum(lengths) > 300:
        pytest.skip("too large for the interpreter")
    heads = 4
    g = torch.Generator().manual_seed(head_dim + len(lengths))
    q, k, v = torch.randn(sum(lengths), 3, heads, head_dim, generator=g).to(dtype).to(DEVICE).unbind(1)
    segments = Segments.build(lengths, DEVICE)
    cu = torch.cat([segments.cu_seqlens, segments.cu_seqlens[-1:].repeat(3)])
    out = varlen_attention(q, k, v, cu, max(lengths), head_dim ** -0.5)
    ref = varlen_attention_reference(q.double(), k.double(), v.double(), segments, head_dim ** -0.5)
    assert rel_err(out, ref) < tol(dtype)


# ---- silu_mul (the gated MLP's activation for prefill-sized rows) ------------------------------------------------

@pytest.mark.parametrize("m, features", [(1, 64), (3, 1000), (1024, 12288), (17, 18944)])  # partial blocks included
def test_silu_mul_matches_torch(m, features):
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    if INTERPRET and m * features > 4096:
        pytest.skip("interpreter: small shapes")
    g = torch.Generator(device=DEVICE).manual_seed(m + features)
    gate_up = (4 * torch.randn(m, 2 * features + 8, device=DEVICE, generator=g)).to(dtype)[:, :2 * features]
    gate, up = gate_up.double().chunk(2, -1)
    exact = torch.nn.functional.silu(gate) * up
    out = silu_mul(gate_up)  # rows strided by 2F + 8
    err, err_ref = rel_err(out, exact), rel_err(silu_and_mul(gate_up), exact)
    print(f"silu_mul {m}x{features} {dtype}: {err:.2e} (torch {err_ref:.2e})")
    assert out.shape == (m, features) and err <= 2 * err_ref + 1e-6


# ---- the vision towers' fused epilogue and norm (cuBLASLt GELU epilogue, inductor add + LayerNorm) ----------------

@gpu_only
@pytest.mark.parametrize("rows", [1, 37, 1024])
def test_vision_mlp_gelu_epilogue_matches_float64(rows):
    """Qwen3-VL's tower MLP: bias and tanh-GELU in fc1's epilogue, no worse than the unfused bf16 ops."""
    torch.manual_seed(rows)
    mlp = MLP(1152, 4304, "gelu_pytorch_tanh").to(DEVICE, torch.bfloat16)
    x = torch.randn(rows, 1152, device=DEVICE, dtype=torch.bfloat16)
    w1, b1, w2, b2 = (t.double() for t in (mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight,
                                            mlp.linear_fc2.bias))
    h = torch.nn.functional.gelu(x.double() @ w1.T + b1, approximate="tanh")
    exact = h @ w2.T + b2
    unfused = mlp.linear_fc2(mlp.act(mlp.linear_fc1(x)))
    err, err_ref = rel_err(mlp(x), exact), rel_err(unfused, exact)
    print(f"vision MLP {rows} rows: {err:.2e} (unfused {err_ref:.2e})")
    assert mlp.gelu_epilogue and err <= 1.5 * err_ref + 1e-6


@gpu_only
@pytest.mark.parametrize("rows", [1, 37, 1024])
def test_layer_norm_with_residual_matches_float64(rows):
    torch.manual_seed(rows)
    norm = LayerNorm(1152, eps=1e-6).to(DEVICE, torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    torch.nn.init.normal_(norm.bias, 0.0, 0.1)
    x, residual = (torch.randn(rows, 1152, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    out, total = norm(x, residual)
    s = x.double() + residual.double()
    exact = torch.nn.functional.layer_norm(s, (1152,), norm.weight.double(), norm.bias.double(), norm.eps)
    err, err_ref = rel_err(out, exact), rel_err(torch.nn.functional.layer_norm(x + residual, (1152,), norm.weight,
                                                                             norm.bias, norm.eps), exact)
    print(f"add + LayerNorm {rows} rows: {err:.2e} (unfused {err_ref:.2e})")
    assert err <= 1.5 * err_ref + 1e-6 and torch.equal(total, x + residual)


# ---- skinny GEMM (decode-sized linear layers) ----------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 8, MAX_ROWS])
@pytest.mark.parametrize("n, k, bias", [(4096, 4096, False), (6144, 4096, True), (1000, 4104, True), (37, 72, False),
                                        (151936, 256, False)])
def test_skinny_gemm_matches_linear(dtype, m, n, k, bias):
    g = torch.Generator(device=DEVICE).manual_seed(n + k + m)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE, generator=g).to(dtype) if bias else None
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    ref = torch.nn.functional.linear(x, w, b)
    out = skinny_gemm(x, w, b)
    err, err_ref = rel_err(out, exact), rel_err(ref, exact)
    print(f"skinny gemm {m}x{k} @ {n}x{k} {dtype}: {err:.2e} (cuBLAS {err_ref:.2e})")
    assert err < 2 * err_ref + 1e-4


@gpu_only
@pytest.mark.parametrize("config", [Config(16, 128, 4, 3), Config(32, 512, 8, 4), Config(64, 256, 4, 5)])
def test_skinny_gemm_configs_and_strided_rows(config):
    g = torch.Generator(device=DEVICE).manual_seed(7)
    x = torch.randn(5, 2 * 1536, device=DEVICE, generator=g).to(torch.bfloat16)[:, :1536]  # row stride 2K
    w = torch.randn(2000, 1536, device=DEVICE, generator=g).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    assert rel_err(skinny_gemm(x, w, config=config), exact) < 5e-3


def silu_mul_exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    gate, up = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("m", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("n, k, bias", [(512, 512, False), (74, 200, True)])  # 37 features, a partial K block
def test_skinny_gemm_silu_mul_matches_linear_then_activation(m, n, k, bias):
    """The MLP's gate_up projection with silu(gate) * up in the epilogue, against float64 and the torch path."""
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = torch.Generator(device=DEVICE).manual_seed(m + n + k)
    x = torch.randn(m, k + 8, device=DEVICE, generator=g).to(dtype)[:, :k]  # strided rows
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE, generator=g).to(dtype) if bias else None
    gate, up = torch.nn.functional.linear(x, w, b).chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up
    out = skinny_gemm(x, w, b, config=Config(32, 64, 4, 2) if INTERPRET else None, silu_mul=True)
    err, err_ref = rel_err(out, silu_mul_exact(x, w, b)), rel_err(ref, silu_mul_exact(x, w, b))
    print(f"skinny gemm + silu_mul {m}x{k} @ {n}x{k} {dtype}: {err:.2e} (torch {err_ref:.2e})")
    assert err < 2 * err_ref + 1e-4


def normed_linear_exact(x, r, g, eps, mode, w, b, silu_mul):
    """float64 linear(norm(x + r)) with the sum rounded to x's dtype first, as the residual stream is."""
    s = (x.double() + r.double()).to(x.dtype).double()
    n = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (1 + g.double() if mode == "zero_centred" else
                                                                  g.double())
    if silu_mul:
        return silu_mul_exact(n, w, b)
    return torch.nn.functional.linear(n, w.double(), None if b is None else b.double())


@pytest.mark.parametrize("m", [1, 5, MAX_ROWS])
@pytest.mark.parametrize("mode", ["rms", "zero_centred"])
@pytest.mark.parametrize("n, k, bias, silu_mul", [(512, 512, False, False), (74, 200, True, True),
                                                  (1000, 4104, True, False)])
def test_skinny_gemm_normed_matches_norm_then_linear(m, mode, n, k, bias, silu_mul):
    """The pre-norm block's residual add and RMSNorm in the GEMM's prologue, against float64 and the torch path
    (the norm kernels, then F.linear); the returned sum must equal the residual stream's rounded sum exactly."""
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    g = torch.Generator(device=DEVICE).manual_seed(m + n + k)
    x = (3 * torch.randn(m, k + 8, device=DEVICE, generator=g)).to(dtype)[:, :k]  # strided rows
    r = (3 * torch.randn(m, k, device=DEVICE, generator=g)).to(dtype)
    gain = (0.1 * torch.randn(k, device=DEVICE, generator=g) + (mode == "rms")).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=DEVICE, generator=g).to(dtype) if bias else None
    eps = 1e-6
    normed, ref_total = ADD_NORMS[mode](x, r, gain, eps)
    ref = torch.nn.functional.linear(normed, w, b)
    ref = silu_and_mul(ref) if silu_mul else ref
    config = Config(32, 64, 4, 2) if INTERPRET else None
    out, total = skinny_gemm_normed(x, r, gain, eps, mode, w, b, config=config, silu_mul=silu_mul)
    exact = normed_linear_exact(x, r, gain, eps, mode, w, b, silu_mul)
    err, err_ref = rel_err(out, exact), rel_err(ref, exact)
    print(f"skinny gemm + {mode} norm {m}x{k} @ {n}x{k} silu_mul={silu_mul} {dtype}: {err:.2e} (torch {err_ref:.2e})")
    assert err < 2 * err_ref + 1e-4
    assert torch.equal(total, (x.float() + r.float()).to(dtype)) and torch.equal(total, ref_total)


@gpu_only
@pytest.mark.parametrize("silu_mul, exact", [(False, lambda x, w: x.double() @ w.double().T),
                                             (True, lambda x, w: silu_mul_exact(x, w, None))],
                         ids=["linear", "linear_silu_mul"])
def test_linear_op_routes_by_rows_inside_a_cuda_graph(silu_mul, exact):
    """The op the compiled body calls: graph replays with new inputs match float64 for skinny and large batches."""
    w = torch.randn(512, 256, device=DEVICE, dtype=torch.bfloat16) / 16
    for rows in (3, 64):
        x = torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16)
        linear_op(x, w, None, silu_mul)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = linear_op(x, w, None, silu_mul)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert rel_err(y, exact(x, w)) < 5e-3


@gpu_only
@pytest.mark.parametrize("silu_mul", [False, True])
def test_normed_linear_op_routes_by_rows_inside_a_cuda_graph(silu_mul):
    """The compiled body's pre-norm projection: fused at decode rows, norm kernel then cuBLAS at 64; graph replays
    with new inputs match float64, and the sum it returns is the residual stream's."""
    w = torch.randn(512, 256, device=DEVICE, dtype=torch.bfloat16) / 16
    gain = 1 + 0.1 * torch.randn(256, device=DEVICE, dtype=torch.bfloat16)
    for rows in (3, 64):
        x, r = (torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        normed_linear_op(x, r, gain, 1e-6, "rms", w, None, silu_mul)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, total = normed_linear_op(x, r, gain, 1e-6, "rms", w, None, silu_mul)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            r.copy_(torch.randn_like(r))
            graph.replay()
            assert rel_err(y, normed_linear_exact(x, r, gain, 1e-6, "rms", w, None, silu_mul)) < 5e-3
            assert torch.equal(total, x + r)
