"""Full CUDA graphs for pure-decode steps (trtllm's `cuda_graph_config`): the LM forward plus the LM head, captured
once per padded batch size, largest first, in one memory pool.

A graph reads its inputs from the model runner's staging buffers, whose device addresses never change, so a
replay needs only the step's arrays staged there. Rows past the real batch are padding: slot -1 (the KV store
skips it) and KV length 0 (attention writes zeros), so they touch no cache block. Every decode step qualifies,
text-only or multimodal (decode tokens are text), whenever its batch fits the largest captured size. With
piecewise prefill graphs on, the graph records the compiled LM body, so decode gets inductor's fused kernels too. Hybrid
models (Qwen3.5) update their linear-attention states in the graph too, gathered and scattered by the slot ids
staged with the step; padding rows use the state pool's scratch slot.
"""
import bisect

import numpy as np
import torch

from ..config import CudaGraphConfig
from ..layers.forward_context import ForwardContext, StateMetadata, reset_context, set_context
from ..utils.logging import logger


def capture_sizes(config: CudaGraphConfig, max_batch_size: int) -> list[int]:
    """The configured sizes, or 1, 2, 4 and then every multiple of 8 up to the largest batch."""
    largest = min(config.max_batch_size or max_batch_size, max_batch_size)
    sizes = config.batch_sizes or [1, 2, 4, *range(8, largest + 1, 8), largest]
    return sorted({s for s in sizes if 0 < s <= largest})


class DecodeGraphs:
    def __init__(self, runner, config: CudaGraphConfig, max_batch_size: int, padding_slot: int | None):
        self.runner = runner
        self.padding_slot = padding_slot  # hybrids: the state pool's scratch slot
        sizes = capture_sizes(config, min(max_batch_size, runner.max_num_tokens))
        # The compiled LM body is traced for two or more tokens; batch 1 pads to 2, which streams the same weights.
        smallest = 2 if runner.piecewise is not None else 1
        self.sizes = sorted({max(s, smallest) for s in sizes})
        self.padding = config.enable_padding
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.eager_decodes = 0

    def size_for(self, batch_size: int) -> int | None:
        """The captured size that runs a decode batch: the exact one, or with padding the next larger."""
        i = bisect.bisect_left(self.sizes, batch_size)
        if i == len(self.sizes) or (self.sizes[i] != batch_size and not self.padding):
            return None
        return self.sizes[i]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            dev, meta = self.runner.stage(padding_inputs(size, self.runner.max_blocks_per_seq, self.padding_slot))
            state = self.state_metadata(size, dev)
            try:
                self.forward(dev, meta, state, size)  # compiles the kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self.forward(dev, meta, state, size)
            finally:
                reset_context()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("decode CUDA graphs captured for batch sizes %s (padding %s)", self.sizes,
                    "on" if self.padding else "off")

    def state_metadata(self, size: int, dev: dict) -> StateMetadata | None:
        """Hybrid models: the batched decode update, reading each row's state slot from the staging buffer."""
        if self.padding_slot is None:
            return None
        return StateMetadata(dev["state_slots"], [1] * size, [], [False] * size, [[]] * size, decode=True)

    def forward(self, dev: dict, meta, state: StateMetadata | None, size: int) -> torch.Tensor:
        """The LM body the runner uses (the compiled one when piecewise graphs are on, its pieces then run inside
        this graph) and the LM head. Deepstack rows are zeroed inside the graph: decode tokens are text."""
        set_context(ForwardContext(meta, self.runner.step_deepstack(size, None), state))
        return self.runner.model.compute_logits(self.runner.body(dev, None, None)).float()

    def replay(self, size: int, batch_size: int) -> torch.Tensor:
        if self.replays == 0:
            logger.info("first decode step under a CUDA graph: batch %d padded to %d", batch_size, size)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:batch_size]


def padding_inputs(size: int, width: int, state_slot: int | None) -> dict:
    """Decode inputs for `size` rows that touch nothing: no cache slot, no keys, the scratch state slot."""
    state = {} if state_slot is None else {"state_slots": np.full(size, state_slot, dtype=np.int64)}
    return {**state,
        "input_ids": np.zeros(size, dtype=np.int64), "positions": np.zeros((3, size), dtype=np.int64),
        "slot_mapping": np.full(size, -1, dtype=np.int64), "cu_seqlens_q": np.arange(size + 1, dtype=np.int32),
        "seq_lens_k": np.zeros(size, dtype=np.int32), "block_tables": np.zeros((size, width), dtype=np.int32),
        "token_seq": np.arange(size, dtype=np.int64), "token_pos": np.zeros(size, dtype=np.int64),
        "logits_indices": np.arange(size, dtype=np.int64), "max_q": 1, "max_k": 1,
    }


def pad_decode(host: dict, size: int, width: int, state_slot: int | None) -> dict:
    """A real decode batch's inputs padded to a captured size, block tables to the graphs' fixed width."""
    padded = padding_inputs(size, width, state_slot)
    n = len(host["input_ids"])
    for name in ("input_ids", "slot_mapping", "seq_lens_k", "logits_indices", "state_slots"):
        if name in padded:
            padded[name][:n] = host[name]
    padded["positions"][:, :n] = host["positions"]
    tables = host["block_tables"]
    padded["block_tables"][:n, :tables.shape[1]] = tables
    padded["max_k"] = host["max_k"]
    return padded
