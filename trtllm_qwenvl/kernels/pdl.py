"""Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel before it
in the stream is still finishing, so its launch and set-up overlap that kernel's tail instead of following it.

A decode step is a chain of a few hundred short kernels, each costing a few microseconds of launch and ramp-up
beyond its bytes; PDL hides part of that. Every kernel launched with it must wait (`gdc_wait`) before it touches
anything the previous kernel writes, and before it ends, so that the kernel after it, which waits only on its
direct predecessor, still sees everything written before. Our kernels wait first and then let the next kernel
launch (`gdc_launch_dependents`); inductor's kernels do the same with its `triton.enable_pdl` option. The skinny
GEMM lets the next kernel launch later, near the end of its stream (kernels.skinny_gemm says why).

TRTLLM_QWENVL_PDL=0 turns it off (for A/B timing); Triton's interpreter and older GPUs never use it. The engine
imports this module only on CUDA, where Triton is installed.
"""
import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("TRTLLM_QWENVL_PDL", "1") == "1"
            and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_args(device: torch.device) -> dict:
    """A launch's PDL arguments: the kernel's `PDL` switch for `enter`, and Triton's launch attribute."""
    pdl = pdl_enabled(device)
    return {"PDL": pdl, "launch_pdl": pdl}


def inductor_options(device: torch.device) -> dict:
    """Inductor config for code compiled to run on `device`: its Triton kernels join the PDL chain."""
    from torch._inductor import config
    return {"triton.enable_pdl": True} if pdl_enabled(device) and hasattr(config.triton, "enable_pdl") else {}


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first statement: wait for the kernel before it, then let the next one launch."""
    wait(PDL)
    release(PDL)


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this (or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
