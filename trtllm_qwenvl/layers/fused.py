"""Elementwise chains that torch.compile (inductor) fuses into one kernel each on CUDA.

A decode step is mostly small kernels: an RMSNorm written in torch is about eight launches, a rotary ten. Under
a CUDA graph each still costs a couple of microseconds of GPU time, so fusing them is what brings a step near
the weight-streaming floor. Off CUDA the same functions run eagerly: they are also the reference.

Each function keeps its inputs to one rank, so dynamo's variants stay few (dtype, and size 1 against the rest).
A function that dynamo still cannot serve (its recompile limit, say) falls back to eager for good, with a warning.
"""
import functools

import torch

from ..utils.logging import logger


def fused_on_cuda(fn):
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    state = {"compiled": True}

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        # Inside an enclosing torch.compile (the piecewise LM body) the plain function is traced into its graph.
        if torch.compiler.is_compiling() or not (x.is_cuda and state["compiled"]):
            return fn(x, *args)
        try:
            return compiled(x, *args)
        except Exception as e:  # dynamo/inductor errors: the eager function computes the same result
            state["compiled"] = False
            logger.warning("%s runs eagerly from now on: torch.compile failed (%s: %s)", fn.__name__,
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return fn(x, *args)
    return call
