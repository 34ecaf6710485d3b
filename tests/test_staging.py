"""StagingBuffers: a step's arrays packed into one buffer, each readable back as its own dtype and shape, at
addresses that depend only on the shapes staged before it (what CUDA graphs replay on)."""
import numpy as np
import pytest
import torch

from trtllm_qwenvl.utils.h2d import StagingBuffers

SIZES = {"ids": (64, torch.long), "positions": (3 * 64, torch.long), "lens": (9, torch.int32),
         "tables": (8 * 5, torch.int32), "extra": (8, torch.long)}


def step(n: int, seqs: int, rng) -> dict:
    return {"ids": rng.integers(0, 1000, n), "positions": rng.integers(0, 99, (3, n)),
            "lens": rng.integers(0, 50, seqs + 1).astype(np.int32),
            "tables": rng.integers(0, 7, (seqs, 3)).astype(np.int32)}


def test_arrays_come_back_with_their_values_dtypes_and_shapes():
    staging = StagingBuffers(SIZES, torch.device("cpu"))
    host = step(13, 3, np.random.default_rng(0))
    dev = staging.put_all(host)
    for name, array in host.items():
        assert dev[name].dtype == SIZES[name][1] and dev[name].shape == array.shape
        assert np.array_equal(dev[name].numpy(), array)
        assert dev[name].data_ptr() % 16 == 0


def test_addresses_depend_only_on_the_shapes_before():
    staging = StagingBuffers(SIZES, torch.device("cpu"))
    rng = np.random.default_rng(1)
    first = {k: v.data_ptr() for k, v in staging.put_all(step(16, 4, rng)).items()}
    again = {k: v.data_ptr() for k, v in staging.put_all(step(16, 4, rng)).items()}
    assert first == again
    # Per-token arrays come first: another batch layout of the same token count keeps their addresses.
    other = staging.put_all({**step(16, 2, rng), "extra": np.arange(3)})
    assert [other[k].data_ptr() for k in ("ids", "positions")] == [first["ids"], first["positions"]]
    assert np.array_equal(other["extra"].numpy(), np.arange(3))


def test_unknown_or_oversized_arrays_are_refused():
    staging = StagingBuffers(SIZES, torch.device("cpu"))
    with pytest.raises(KeyError, match="nope"):
        staging.put_all({"nope": np.zeros(2)})
    with pytest.raises(ValueError, match="ids has 65 entries"):
        staging.put_all({"ids": np.zeros(65, dtype=np.int64)})
