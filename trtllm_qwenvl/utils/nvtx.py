"""NVTX ranges that cost nothing when the `nvtx` package is absent."""
import contextlib

try:
    import nvtx as _nvtx
except ImportError:  # the GPU box may lack the wheel; ranges are optional there
    _nvtx = None


def nvtx_range(name: str):
    if _nvtx is None:
        return contextlib.nullcontext()
    return _nvtx.annotate(name, domain="trtllm_qwenvl")
