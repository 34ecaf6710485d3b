"""Elementwise chains that torch.compile (inductor) fuses into one kernel each on CUDA.

A decode step is mostly small kernels: an RMSNorm written in torch is about eight launches, a rotary ten. Under
a CUDA graph each still costs a couple of microseconds of GPU time, so fusing them is what brings a step near
the weight-streaming floor. Off CUDA the same functions run eagerly: they are also the reference.
"""
import functools

import torch


def fused_on_cuda(fn):
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args, **kwargs):
        return compiled(x, *args, **kwargs) if x.is_cuda else fn(x, *args, **kwargs)
    return call
