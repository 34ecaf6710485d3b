"""Piecewise CUDA graphs for the LM body in prefill (trtllm's `torch_compile_config`).

Only attention depends on how a step's tokens split into sequences; every other op of the body is row-wise over
the step's N tokens. So torch.compile traces the body once with N symbolic (taken from `inputs_embeds`: the
runner always passes embeddings here), and our backend splits the FX graph at each `trtllm_qwenvl::paged_attention`
call. Each piece between two attention calls is compiled by inductor for symbolic N and recorded in one CUDA graph
per capture size; attention runs eagerly between the pieces. A step's tokens are padded to the next capture size:
padding rows have no KV slot and belong to no sequence, so attention skips them, and the row-wise ops cannot carry
them into a real row.

Memory: every piece at every size records into one pool. A piece keeps only non-owning views of its outputs, so
the pool reuses the memory of values no later piece reads, exactly as the capturing forward freed them.

Dispatch: dynamo's entry into the compiled body gathers its 370 inputs (every weight, buffer and KV cache of the
8B model) from the modules on every call: 0.75-0.87 ms of host time before the first piece launched on an H100
host, guards skipped, on TTFT's critical path. So the call that records a size keeps the arguments dynamo passed,
and later steps of that size call the split module with them directly, the step's embeddings and positions swapped
in (0.05 ms). Everything else it reads is the same object every step: parameters, buffers, the KV caches and the
runner's deepstack buffer.
"""
import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.split_module import split_module

from ..config import TorchCompileConfig
from ..layers import attention  # noqa: F401 (registers the op)
from ..utils.logging import logger

ATTENTION = torch.ops.trtllm_qwenvl.paged_attention.default


def capture_sizes(config: TorchCompileConfig, max_num_tokens: int) -> list[int]:
    """The configured token counts, or 16 to 256 in powers of two and then every multiple of 256: a prefill is
    compute-bound, so padding must stay a small fraction of it."""
    sizes = config.capture_num_tokens or [16, 32, 64, 128, *range(256, max_num_tokens + 1, 256), max_num_tokens]
    return sorted({s for s in sizes if 2 <= s <= max_num_tokens})


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """Submodules in graph order: each run of ops between attention calls, and each attention call alone. Returns
    the split module and the names of its non-attention pieces."""
    part, parts = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is ATTENTION:
            parts[node] = part + 1
            part += 2
        else:
            parts[node] = part
    split = split_module(gm, None, lambda node: parts[node], keep_original_order=True)
    attention_parts = {p for node, p in parts.items() if node.op == "call_function" and node.target is ATTENTION}
    return split, [f"submod_{p}" for p in sorted(set(parts.values()) - attention_parts)]


def non_owning(value):
    """A view of a tensor's memory that does not keep it allocated (recursing into tuples and lists)."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
        return torch.empty(0, dtype=value.dtype, device=value.device).set_(
            alias, value.storage_offset(), value.shape, value.stride())
    if isinstance(value, (tuple, list)):
        return type(value)(non_owning(v) for v in value)
    return value


def replay_inputs(args) -> list:
    """What a replay depends on: each device tensor's address, and each host scalar's value. Dynamo passes a float
    attribute as a host scalar once it has seen two values of it (two models in one process with different norm
    eps): a fresh tensor every call, whose value the capture baked in."""
    return [a.item() if a.device.type == "cpu" and a.numel() == 1 else a.data_ptr()
            for a in args if isinstance(a, torch.Tensor)]


@dataclass
class Call:
    """The arguments dynamo passed the split module when a size was recorded, and where the step's inputs sit."""
    split: fx.GraphModule
    args: tuple
    embeds: int
    positions: int

    def run(self, positions: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        args = list(self.args)
        args[self.embeds], args[self.positions] = embeds, positions
        return self.split(*args)[0]  # the body returns one tensor: dynamo's graph outputs (hidden,)


@dataclass
class Recording:
    graph: torch.cuda.CUDAGraph
    outputs: object
    inputs: list


class Piece:
    """One piece: its compiled callable, and a CUDA graph of it per capture size, recorded on first use."""

    def __init__(self, run, owner: "PiecewiseGraphs"):
        self.run = run
        self.owner = owner
        self.recordings: dict[int, Recording] = {}

    def __call__(self, *args):
        size = self.owner.size
        if size is None:
            return self.run(*args)
        rec = self.recordings.get(size)
        if rec is None:
            return self.record(size, args)
        if replay_inputs(args) != rec.inputs:
            # A replay reads the addresses and host values it recorded: anything else would silently compute on
            # stale memory.
            raise RuntimeError(f"piecewise graph for {size} tokens called with inputs at new addresses or values")
        rec.graph.replay()
        return rec.outputs

    def record(self, size: int, args):
        self.run(*args)  # first calls compile and autotune: keep them out of the capture
        graph = torch.cuda.CUDAGraph()
        with self.owner.capturing(graph):
            outputs = self.run(*args)
        self.recordings[size] = Recording(graph, non_owning(outputs), replay_inputs(args))
        # The caller holds these until their last reader is recorded, so no later piece reuses their memory early.
        return outputs


class PieceCompiler(fx.Interpreter):
    """Runs the split module on fake inputs, so each piece is compiled for the symbolic shapes it really sees, and
    swaps each piece for its `Piece` wrapper."""

    def __init__(self, split: fx.GraphModule, pieces: list[str], owner: "PiecewiseGraphs"):
        super().__init__(split)
        self.names = set(pieces)
        self.owner = owner
        self.pieces: list[Piece] = []

    def call_module(self, target, args, kwargs):
        out = super().call_module(target, args, kwargs)
        if target in self.names:
            submod = self.fetch_attr(target)
            piece = Piece(self.owner.compile_piece(submod, args), self.owner)
            self.pieces.append(piece)
            # The split module's forward looks its pieces up as attributes; the instance dict shadows _modules.
            self.module.__dict__[target] = piece
        return out


class PiecewiseGraphs:
    """The compiled LM body and its per-size graphs. `forward` runs one step; `size` (a capture size, or None to
    run the pieces without graphs) is set only for the duration of that call."""

    def __init__(self, model, config: TorchCompileConfig, max_num_tokens: int, device: torch.device):
        self.sizes = capture_sizes(config, max_num_tokens)
        self.device = device
        self.graphs_on = device.type == "cuda"
        self.size: int | None = None
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_on else None
        self.stream = torch.cuda.Stream(device) if self.graphs_on else None
        self.pieces: list[Piece] = []  # set by the first call, which compiles the body
        self.compiles = 0
        self.replays = 0
        self.calls: dict[int, Call] = {}  # per padded size: the direct call into the split module
        self.entering: tuple | None = None  # (size, positions, embeds) of a step entering through dynamo
        self.body = torch.compile(model.forward, backend=self.backend, fullgraph=True)

    def backend(self, gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
        split, pieces = split_at_attention(gm)
        fake_mode = detect_fake_mode(example_inputs)
        fake = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        compiler = PieceCompiler(split, pieces, self)
        with fake_mode:
            compiler.run(*fake)
        self.pieces = compiler.pieces
        self.compiles += 1
        log = logger.info if self.compiles == 1 else logger.warning  # a recompile records its graphs anew
        log("LM body compiled (%d) in %d pieces around %d attention calls", self.compiles, len(pieces),
            sum(node.target is ATTENTION for node in gm.graph.nodes))
        self.calls = {}  # a recompile records every size anew
        return functools.partial(self.enter, split)

    def enter(self, split: fx.GraphModule, *args):
        """Dynamo's call into the split module. The first call of a padded size (on CUDA, the one recording its
        graphs) keeps its arguments for that size's later steps."""
        if self.entering is not None and self.entering[0] is not None:
            self.keep(split, args, *self.entering)
        return split(*args)

    def keep(self, split: fx.GraphModule, args: tuple, size: int, positions: torch.Tensor,
             embeds: torch.Tensor) -> None:
        where = [next((i for i, a in enumerate(args) if a is t), None) for t in (embeds, positions)]
        if None in where:  # a dynamo that copies its inputs: keep its entry, guards and all
            logger.warning("dynamo did not pass the step's tensors through; piecewise steps keep its dispatch")
            return
        self.calls[size] = Call(split, args, *where)

    def compile_piece(self, submod: fx.GraphModule, example_args):
        """Inductor on CUDA fuses each piece's elementwise chains; elsewhere the piece runs as traced."""
        if not self.graphs_on:
            return submod
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        from ..kernels.pdl import inductor_options
        with config.patch(inductor_options(self.device)):
            return compile_fx(submod, list(example_args))

    def size_for(self, num_tokens: int) -> int | None:
        """The capture size a step of `num_tokens` pads to, or None when it is larger than every size. Off CUDA
        steps pad the same way and run the pieces without graphs."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, size: int | None) -> torch.Tensor:
        self.size = size if self.graphs_on else None
        call = self.calls.get(size)
        try:
            if call is not None:
                hidden = call.run(positions, embeds)
            else:
                torch._dynamo.mark_dynamic(embeds, 0)
                torch._dynamo.mark_dynamic(positions, 1)
                self.entering = (size, positions, embeds)
                hidden = self.body(positions, inputs_embeds=embeds)
        finally:
            self.size = None
            self.entering = None
        if self.graphs_on and size is not None:
            if self.replays == 0:
                logger.info("first step under piecewise CUDA graphs: %d tokens", size)
            self.replays += 1
        return hidden

    @contextlib.contextmanager
    def capturing(self, graph: torch.cuda.CUDAGraph):
        """torch.cuda.graph without its per-capture gc.collect and empty_cache: a model has dozens of pieces."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                yield
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.stream)
