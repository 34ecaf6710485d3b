"""Vision-tower host-overhead features, each shown by a test that fails without it, plus tower parity with HF."""
import numpy as np
import pytest
import torch

from trtllm_qwenvl.layers import vision_attention
from trtllm_qwenvl.models import qwen2_5_vl, qwen3_vl

from conftest import relative_error

ARCH_MODULES = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}


@pytest.fixture(scope="module", params=sorted(ARCH_MODULES))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def towers(arch, checkpoints, references):
    from trtllm_qwenvl.config import LlmArgs
    from trtllm_qwenvl.engine.llm_engine import build_model
    from transformers import AutoConfig
    path = checkpoints(arch)
    ours = build_model(LlmArgs(model=str(path)), AutoConfig.from_pretrained(path), torch.device("cpu"),
                       torch.float32)
    return ours, references(arch).model.model.visual


def pixels_for(arch, grids, seed=0):
    vc = {"qwen2_5_vl": (3 * 2 * 14 * 14), "qwen3_vl": (3 * 2 * 16 * 16)}[arch]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(int(np.prod(x)) for x in grids), vc, generator=g)


# Two images and a 2-frame video with several attention windows each, batched in one call.
GRIDS = [(1, 16, 24), (1, 12, 8), (2, 8, 16)]


def test_tower_matches_hf_batched(arch, towers):
    ours, hf = towers
    px = pixels_for(arch, GRIDS)
    with torch.no_grad():
        expected = hf(px, grid_thw=torch.tensor(GRIDS)).pooler_output
        got = ours.encode(px, GRIDS).embeds
    # Window attention permutes patches; a wrong inverse permutation (argsort of the window order) breaks this.
    assert relative_error(got, expected) <= 1e-5


def test_repeated_grid_does_no_new_h2d(arch, towers, monkeypatch):
    ours, _ = towers
    module = ARCH_MODULES[arch]
    calls = []
    real = module.async_tensor_h2d
    monkeypatch.setattr(module, "async_tensor_h2d", lambda *a, **k: calls.append(a) or real(*a, **k))
    grid = (1, 20, 20)
    ours.visual.grids.entries.pop(grid, None)
    with torch.no_grad():
        ours.encode(pixels_for(arch, [grid]), [grid])
        first = len(calls)
        hits = ours.visual.grids.hits
        ours.encode(pixels_for(arch, [grid], seed=1), [grid])
    assert first > 0
    assert len(calls) == first
    assert ours.visual.grids.hits == hits + 1


def test_cu_seqlens_built_on_host_and_copied_once(arch, towers, monkeypatch):
    ours, _ = towers
    copies = []
    real = vision_attention.async_tensor_h2d
    monkeypatch.setattr(vision_attention, "async_tensor_h2d",
                        lambda data, *a, **k: copies.append(data) or real(data, *a, **k))
    with torch.no_grad():
        ours.encode(pixels_for(arch, GRIDS), GRIDS)
    # One copy per segment layout: frames (+ windows for Qwen2.5), each a host int32 array.
    assert len(copies) == (2 if arch == "qwen2_5_vl" else 1)
    assert all(isinstance(c, np.ndarray) and c.dtype == np.int32 for c in copies)


def test_rotary_tables_are_precomputed(arch, towers, monkeypatch):
    ours, _ = towers
    px = pixels_for(arch, GRIDS)
    with torch.no_grad():
        ours.encode(px, GRIDS)  # warm the grid cache

        def forbidden(*_a, **_k):
            raise AssertionError("cos/sin computed during a forward")
        for name in ("cos", "sin"):
            monkeypatch.setattr(torch, name, forbidden)
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        ours.encode(px, GRIDS)
        positions = torch.arange(12).expand(3, 12)
        from trtllm_qwenvl.layers.rotary import MRotaryEmbedding
        rotary = next(m for m in ours.modules() if isinstance(m, MRotaryEmbedding))
        cos, sin = rotary(positions)
    assert cos.shape == sin.shape == (12, rotary.cos_table.shape[1])


def test_window_index_matches_hf():
    from transformers.vision_utils import get_vision_window_index
    for grid in [(1, 16, 24), (2, 8, 16), (1, 6, 10)]:
        expected, cu = get_vision_window_index(torch.tensor([grid]), 2, 112, 14)
        order, lens = qwen2_5_vl.window_index(*grid, merge=2, window=4)
        assert order.tolist() == expected.tolist()
        assert np.concatenate(([0], np.cumsum(lens))).tolist() == cu.tolist()
