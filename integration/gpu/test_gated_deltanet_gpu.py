"""flash-linear-attention's gated delta rule kernels (bf16, CUDA) against our torch reference
(`layers/gated_delta_rule.py`, fp32) at Qwen3.5-9B shapes, and a GatedDeltaNet layer on CUDA (which then runs the
fla kernels) against the same layer in fp32 on CPU (torch kernels), carried through a state pool.

Skipped without CUDA or without fla. Error is ||out - ref|| / ||ref||. So that nothing passes vacuously: the
reference states must have moved well away from the initial ones, every compared tensor must be finite, and the
layer test poisons the whole state pool with NaN, so a slot that is read without being written (or a fresh
sequence that reads its stale slot) fails.
"""
import inspect

import pytest
import torch
import transformers

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="needs flash-linear-attention (fla)")

from trtllm_qwenvl.engine.state_pool import StatePool  # noqa: E402
from trtllm_qwenvl.layers import gated_delta_rule as reference  # noqa: E402
from trtllm_qwenvl.layers.forward_context import ForwardContext, StateMetadata, reset_context, set_context  # noqa: E402
from trtllm_qwenvl.layers.gated_deltanet import GatedDeltaNet  # noqa: E402

# fla warns when a chunk is shorter than the head count (it suspects a head-first layout); short chunks are valid.
pytestmark = pytest.mark.filterwarnings("ignore:Input tensor shape suggests")
TOL = 2e-2
TEXT = transformers.Qwen3_5TextConfig()  # Qwen3.5-9B: 16 key heads, 32 value heads, head dims 128
KERNELS = {"chunk": (fla.chunk_gated_delta_rule, reference.chunk_gated_delta_rule),
           "recurrent": (fla.fused_recurrent_gated_delta_rule, reference.recurrent_gated_delta_rule)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN/inf in the output (unwritten, or read from a poisoned slot)"
    assert torch.isfinite(ref).all() and ref.norm() > 0, "degenerate reference"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_inputs(length: int, num_states: int = 1, seed: int = 0):
    """q, k (repeated from the key heads up to the value heads, as GatedDeltaNet.heads does), v and beta in bf16;
    g in fp32 as the layer computes it; an fp32 initial state per sequence."""
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    hk, hv, dk, dv = TEXT.linear_num_key_heads, TEXT.linear_num_value_heads, TEXT.linear_key_head_dim, \
        TEXT.linear_value_head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g_, device="cuda")

    q, k = (randn(1, length, hk, dk).repeat_interleave(hv // hk, dim=2).bfloat16() for _ in range(2))
    v = randn(1, length, hv, dv).bfloat16()
    beta = randn(1, length, hv).sigmoid().bfloat16()
    g = -0.5 * torch.rand(1, length, hv, generator=g_, device="cuda")  # per-token log decay in [-0.5, 0]
    state = 0.5 * randn(num_states, hv, dk, dv)
    return q, k, v, g, beta, state


def run_reference(rule, q, k, v, g, beta, state):
    """Our torch kernel in fp32 on the same (bf16-rounded) inputs."""
    return rule(q.float(), k.float(), v.float(), g=g, beta=beta.float(), initial_state=state.clone(),
                output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("length", [1, 37, 300, 1000])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_matches_reference(kernel, length):
    ours, ref_rule = KERNELS[kernel]
    q, k, v, g, beta, state = make_inputs(length)
    out, final = ours(q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    ref, ref_final = run_reference(ref_rule, q, k, v, g, beta, state)
    assert rel_err(state, ref_final) > 5 * TOL, "the state barely moved: the comparison would say nothing"
    assert out.shape == v.shape and final.shape == state.shape and final.dtype == torch.float32
    assert rel_err(out, ref) <= TOL
    assert rel_err(final, ref_final) <= TOL


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_varlen_matches_reference_per_sequence(kernel):
    """Several sequences concatenated into batch 1 with cu_seqlens, one initial state each: how a batched prefill
    (or decode) would call the kernel."""
    ours, ref_rule = KERNELS[kernel]
    if "cu_seqlens" not in inspect.signature(ours).parameters:
        pytest.skip(f"this fla's {ours.__name__} takes no cu_seqlens")
    lengths = [1, 37, 300, 64, 200]
    q, k, v, g, beta, state = make_inputs(sum(lengths), num_states=len(lengths), seed=1)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    out, final = ours(q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        rows = slice(lo, hi)
        ref, ref_final = run_reference(ref_rule, q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows],
                                       state[i:i + 1])
        assert rel_err(out[:, rows], ref) <= TOL, f"sequence {i}"
        assert rel_err(final[i:i + 1], ref_final) <= TOL, f"sequence {i}"


# ---- the layer through a state pool -------------------------------------------------------------------------------

def build_layer(device: str, dtype: torch.dtype) -> GatedDeltaNet:
    """Built on `device` in `dtype`, as the engine builds models, so on CUDA it binds the fla kernels."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return GatedDeltaNet(TEXT.hidden_size, TEXT.linear_num_key_heads, TEXT.linear_num_value_heads,
                                 TEXT.linear_key_head_dim, TEXT.linear_value_head_dim, TEXT.linear_conv_kernel_dim,
                                 TEXT.rms_norm_eps).eval()
    finally:
        torch.set_default_dtype(previous)


def randomize(layer: GatedDeltaNet, seed: int) -> None:
    """Every parameter random at a sane scale, then rounded to bf16 so both layers hold the very same weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = {"A_log": None, "dt_bias": 0.5, "norm.weight": 0.2, "conv_weight": 0.3}.get(name)
            if name == "A_log":  # decay rates in [1, 16], as HF initialises them
                value = torch.empty(p.shape).uniform_(1, 16, generator=g).log()
            elif scale is None:  # projections: unit-variance outputs
                value = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            else:
                value = scale * torch.randn(p.shape, generator=g) + (1.0 if name == "norm.weight" else 0.0)
            p.copy_(value.bfloat16().float())


def run_chunks(layer: GatedDeltaNet, x: torch.Tensor, chunks, device: str) -> torch.Tensor:
    """Feed `chunks` [(rows, slot, fresh, snapshots)] of x through `layer`, one step each (one sequence per step)."""
    outs = []
    for rows, slot, fresh, cuts in chunks:
        meta = StateMetadata(torch.tensor([slot], device=device), [rows.stop - rows.start], [slot], [fresh], [cuts])
        set_context(ForwardContext(state=meta))
        try:
            outs.append(layer(x[rows]))
        finally:
            reset_context()
    return torch.cat(outs)


def poisoned_pool(layer: GatedDeltaNet, device: str, dtype: torch.dtype) -> StatePool:
    pool = StatePool([layer], num_seq_slots=3, num_snapshots=2, device=device, dtype=dtype)
    pool.conv.fill_(float("nan"))
    pool.recurrent.fill_(float("nan"))
    return pool


def test_layer_on_cuda_matches_cpu_through_the_state_pool():
    cpu, gpu = build_layer("cpu", torch.float32), build_layer("cuda", torch.bfloat16)
    assert gpu.chunk_rule.__module__.startswith("fla") and gpu.recurrent_rule.__module__.startswith("fla"), \
        "the CUDA bf16 layer did not bind fla's kernels"
    randomize(cpu, seed=0)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(303, TEXT.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    # Slot 0: a 2-chunk prefill (128 + 172 tokens) then 3 decode steps. The first chunk ends exactly on a snapshot
    # point (slot 3, after token 128); the second saves one 64 tokens in (slot 4, after token 192).
    steps = [(slice(0, 128), 0, True, [(128, 3)]), (slice(128, 300), 0, False, [(64, 4)])] + \
        [(slice(t, t + 1), 0, False, []) for t in range(300, 303)]
    # Slots 1 and 2: new sequences restored from those snapshots, continuing to the end in one chunk each.
    resumes = [(3, 1, 128), (4, 2, 192)]
    results = {}
    for device, layer, dtype in (("cpu", cpu, torch.float32), ("cuda", gpu, torch.bfloat16)):
        pool = poisoned_pool(layer, device, dtype)
        xd = x.to(device, dtype)
        with torch.no_grad():
            out = run_chunks(layer, xd, steps, device)
            resumed = []
            for snapshot, slot, start in resumes:
                pool.copy(snapshot, slot)
                resumed.append(run_chunks(layer, xd, [(slice(start, 303), slot, False, [])], device))
        results[device] = (out, resumed, pool.conv.float().cpu(), pool.recurrent.cpu())
    (ref, ref_resumed, ref_conv, ref_rec), (out, resumed, conv, rec) = results["cpu"], results["cuda"]
    assert rel_err(out.cpu(), ref) <= TOL
    for (_, _, start), a, b in zip(resumes, resumed, ref_resumed):
        assert rel_err(a.cpu(), b) <= TOL and rel_err(b, ref[start:]) <= 1e-4, f"resumed at {start}"
    for slot in range(5):  # every slot written: the sequences' final states and both snapshots
        assert rel_err(conv[:, slot], ref_conv[:, slot]) <= TOL, f"conv state, slot {slot}"
        assert rel_err(rec[:, slot], ref_rec[:, slot]) <= TOL, f"recurrent state, slot {slot}"
    assert rel_err(ref_rec[:, 3], ref_rec[:, 0]) > 5 * TOL, "snapshot and final state should differ"
