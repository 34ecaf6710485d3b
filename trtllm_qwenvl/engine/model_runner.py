"""Turns a scheduled batch into flat device tensors, runs the LM and samples the rows that need a token."""
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..config import CudaGraphConfig, TorchCompileConfig
from ..layers.attention import Attention
from ..layers.attention_backends import active_backend
from ..layers.forward_context import AttentionMetadata, ForwardContext, StateMetadata, set_context, reset_context
from ..layers.gated_deltanet import GatedDeltaNet
from ..utils.h2d import StagingBuffers
from ..utils.logging import logger
from ..utils.nvtx import nvtx_range
from .cuda_graphs import DecodeGraphs, pad_decode
from .encoder_runner import StepMedia
from .piecewise_graphs import PiecewiseGraphs
from .sampler import gather_logprobs, sample
from .scheduler import ScheduledSeq


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class Launched:
    """A step whose tokens are being sampled on the device, and what reading them back needs."""
    seqs: list                     # the sequences of the sampled rows, in row order
    tokens: torch.Tensor           # (len(seqs),) device token ids
    host: torch.Tensor | None      # the pinned buffer they are copied into (CUDA)
    ready: torch.cuda.Event | None  # recorded after that copy
    logprobs: tuple | None = None  # (chosen, top ids, top values) on the device, when any row asked


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return sum(2 * m.num_kv_heads * m.head_dim for m in layers) * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 max_num_tokens: int, max_batch_size: int, max_seq_len: int):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        first = self.attn_layers[0]
        self.kv_cache = torch.zeros(len(self.attn_layers), 2, num_blocks, block_size, first.num_kv_heads,
                                    first.head_dim, dtype=dtype, device=device)
        for layer, cache in zip(self.attn_layers, self.kv_cache):
            layer.k_cache, layer.v_cache = cache[0], cache[1]
        levels = model.num_deepstack_levels
        hidden = model.hf_config.text_config.hidden_size
        self.deepstack = torch.zeros(levels, max_num_tokens, hidden, dtype=dtype, device=device) if levels else None
        self.hybrid = any(isinstance(m, GatedDeltaNet) for m in model.modules())
        self.staging = StagingBuffers(staging_sizes(max_num_tokens, max_batch_size, self.max_blocks_per_seq), device)
        # Two read-back buffers: with the overlap scheduler a step's tokens are copied while the host still reads
        # the previous step's.
        cuda = device.type == "cuda"
        self.sampled = [torch.zeros(max_batch_size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.sampled_ready = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.launches = 0
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.embeds: torch.Tensor | None = None  # the compiled body's static input
        active_backend().reserve(max_batch_size, first.num_heads, first.head_dim, device)

    def enable_decode_graphs(self, config: CudaGraphConfig, max_batch_size: int, padding_slot: int | None) -> None:
        """Capture decode graphs (CUDA and a graph-safe attention backend only)."""
        if self.device.type != "cuda" or not active_backend().graph_safe:
            logger.info("decode CUDA graphs off: they need CUDA and the triton attention backend")
            return
        if not all(getattr(m, "cuda_graph_safe", True) for m in self.model.modules()):
            logger.info("decode CUDA graphs off: the MoE layers' torch dispatch syncs the host")
            return
        self.graphs = DecodeGraphs(self, config, max_batch_size, padding_slot)
        self.graphs.capture()

    def enable_piecewise_graphs(self, config: TorchCompileConfig) -> None:
        """Compile the LM body in pieces around attention; on CUDA capture each piece at every token size."""
        if self.hybrid or not all(getattr(m, "cuda_graph_safe", True) for m in self.model.modules()):
            logger.info("piecewise prefill graphs off: linear-attention and MoE layers are not traceable yet")
            return
        hidden = self.model.hf_config.text_config.hidden_size
        self.embeds = torch.zeros(self.max_num_tokens, hidden, dtype=self.dtype, device=self.device)
        self.piecewise = PiecewiseGraphs(self.model, config, self.max_num_tokens, self.device)
        if self.device.type == "cuda":
            self.capture_piecewise()

    @torch.inference_mode()
    def capture_piecewise(self) -> None:
        """One padding step per size, largest first, so the smaller sizes fit in the memory the larger freed."""
        for size in reversed(self.piecewise.sizes):
            host = padding_prefill(size, self.block_size)
            dev, meta = self.stage(host)
            self.forward(None, None, host, dev, meta, size)
        torch.cuda.synchronize()
        logger.info("piecewise prefill graphs captured for %d token sizes up to %d (%d pieces each)",
                    len(self.piecewise.sizes), self.piecewise.sizes[-1], len(self.piecewise.pieces))

    def build(self, batch: list[ScheduledSeq]):
        """Host-side step inputs, all numpy, staged with one H2D afterwards. Per-token arrays are computed for the
        whole batch at once; only token ids, block-table rows and prompt mRoPE slices are gathered per sequence."""
        n = len(batch)
        starts = np.fromiter((s.start for s in batch), np.int64, n)
        lens = np.fromiter((s.num_tokens for s in batch), np.int64, n)
        cu = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        token_seq = np.repeat(np.arange(n), lens)
        token_pos = np.arange(cu[-1]) - cu[:-1][token_seq]
        index = starts[token_seq] + token_pos  # each token's index in its sequence
        ids = np.fromiter(itertools.chain.from_iterable(s.seq.token_ids[s.start:s.end] for s in batch), np.int64,
                          int(cu[-1]))
        tables = np.zeros((n, max(len(s.seq.block_table) for s in batch)), dtype=np.int32)
        for i, s in enumerate(batch):
            tables[i, :len(s.seq.block_table)] = s.seq.block_table
        slots = tables[token_seq, index // self.block_size].astype(np.int64) * self.block_size + \
            index % self.block_size
        samples = np.array([s.samples for s in batch])
        state = {}
        if self.hybrid:
            state = {"state_slots": np.array([s.seq.state_slot for s in batch], dtype=np.int64)}
        ends = starts + lens
        return {
            **state, "input_ids": ids, "positions": positions(batch, index, token_seq, cu), "slot_mapping": slots,
            "cu_seqlens_q": cu, "seq_lens_k": ends.astype(np.int32), "block_tables": tables, "token_seq": token_seq,
            "token_pos": token_pos, "logits_indices": cu[1:][samples] - 1, "max_q": int(lens.max()),
            "max_k": int(ends.max()),
        }

    def stage(self, host: dict) -> tuple[dict, AttentionMetadata]:
        """Copy the step's arrays to the device through the staging buffers (one non-blocking H2D)."""
        dev = self.staging.put_all({k: v for k, v in host.items() if isinstance(v, np.ndarray)})
        meta = AttentionMetadata(dev["cu_seqlens_q"], dev["seq_lens_k"], dev["block_tables"], dev["slot_mapping"],
                                 dev["token_seq"], dev["token_pos"], host["max_q"], host["max_k"], self.block_size)
        return dev, meta

    def state_metadata(self, batch: list[ScheduledSeq] | None, host: dict, dev: dict) -> StateMetadata | None:
        if not self.hybrid:
            return None
        decode = all(s.num_tokens == 1 and s.start > 0 and not s.snapshots for s in batch)
        return StateMetadata(dev["state_slots"], [s.num_tokens for s in batch],
                             host["state_slots"].tolist(), [s.start == 0 for s in batch],
                             [s.snapshots for s in batch], decode)

    def embed(self, input_ids: torch.Tensor, media: StepMedia | None) -> torch.Tensor:
        embeds = self.model.embed(input_ids)
        if media is not None:
            embeds.index_copy_(0, media.rows, media.embeds.to(embeds.dtype))
        return embeds

    def step_deepstack(self, n: int, media: StepMedia | None) -> torch.Tensor | None:
        """The whole deepstack buffer (the body slices its N rows), with the step's visual rows filled and zeros
        elsewhere. The eager body skips the adds for a step with no visual token; the compiled body always adds,
        so its graph and the buffer's address never change."""
        has_rows = media is not None and media.deepstack is not None
        if self.deepstack is None or not (has_rows or self.piecewise):
            return None
        self.deepstack[:, :n].zero_()
        if has_rows:
            self.deepstack.index_copy_(1, media.rows, media.deepstack.to(self.dtype))
        return self.deepstack

    def graph_size(self, batch: list[ScheduledSeq], media: StepMedia | None) -> int | None:
        if self.graphs is None or media is not None or any(s.num_tokens != 1 for s in batch):
            return None
        size = self.graphs.size_for(len(batch))
        if size is None:
            self.graphs.eager_decodes += 1
        return size

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], media: StepMedia | None, feed: Launched | None = None) -> Launched:
        """Launch the step and its sampling; `collect` reads the tokens. Input tokens still in flight from the
        previous step (`feed`, overlap scheduler) are copied into the step's input ids on the device."""
        with nvtx_range("prepare"):
            host = self.build(batch)
            size = self.graph_size(batch, media)
            padded = None
            if size is not None:
                host = pad_decode(host, size, self.max_blocks_per_seq, self.graphs.padding_slot)
            elif self.piecewise is not None:
                padded = self.piecewise.size_for(len(host["input_ids"]))
                host = pad_tokens(host, padded) if padded else host
            host.update(feed_indices(batch, host["cu_seqlens_q"], feed))  # padding keeps the real rows' places
            dev, meta = self.stage(host)
            if len(host["feed_rows"]):
                dev["input_ids"].index_copy_(0, dev["feed_rows"], feed.tokens.index_select(0, dev["feed_src"]))
        with nvtx_range("forward"):
            if size is not None:
                logits = self.graphs.replay(size, len(batch))
            else:
                logits = self.forward(batch, media, host, dev, meta, padded)
        with nvtx_range("sample"):
            return self.sample(logits, [s.seq for s in batch if s.samples])

    def forward(self, batch, media: StepMedia | None, host: dict, dev: dict, meta: AttentionMetadata,
                padded: int | None = None):
        n = len(host["input_ids"])
        set_context(ForwardContext(meta, self.step_deepstack(n, media), self.state_metadata(batch, host, dev)))
        try:
            hidden = self.body(dev, media, padded)
            return self.model.compute_logits(hidden[dev["logits_indices"]]).float()
        finally:
            reset_context()

    def body(self, dev: dict, media: StepMedia | None, padded: int | None) -> torch.Tensor:
        """The LM body: compiled in pieces from the static embeddings buffer, or eager (token ids straight to the
        embedding when the step has no media)."""
        ids = dev["input_ids"]
        if self.piecewise is not None:
            embeds = self.embeds[:ids.shape[0]]
            embeds.copy_(self.embed(ids, media))
            return self.piecewise.forward(dev["positions"], embeds, padded)
        if media is None:
            return self.model(dev["positions"], input_ids=ids)
        return self.model(dev["positions"], inputs_embeds=self.embed(ids, media))

    def sample(self, logits: torch.Tensor, seqs) -> Launched:
        """Sample on the device and start copying the ids back; nothing here waits for the GPU."""
        tokens = sample(logits, seqs) if seqs else logits.new_zeros(0, dtype=torch.long)
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        logprobs = gather_logprobs(logits, tokens, max(want)) if want else None
        if self.sampled_ready is None:
            return Launched(seqs, tokens, None, None, logprobs)
        i = self.launches % 2
        self.launches += 1
        host = self.sampled[i][:tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        self.sampled_ready[i].record()
        return Launched(seqs, tokens, host, self.sampled_ready[i], logprobs)

    def collect(self, launched: Launched) -> list[SampledToken]:
        ids = self.read(launched)
        if launched.logprobs is None:
            return [SampledToken(t) for t in ids]
        chosen, top_ids, top_values = (t.tolist() for t in launched.logprobs)
        return [SampledToken(t, lp, dict(zip(i[:seq.params.logprobs or 0], v[:seq.params.logprobs or 0])))
                for seq, t, lp, i, v in zip(launched.seqs, ids, chosen, top_ids, top_values)]

    def read(self, launched: Launched) -> list[int]:
        """The step's one wait on the GPU: its sampled ids, through a pinned buffer and an event."""
        if launched.ready is None:
            return launched.tokens.tolist()
        launched.ready.synchronize()
        return launched.host.tolist()


def positions(batch: list[ScheduledSeq], index: np.ndarray, token_seq: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """mRoPE positions (3, N): text past the prompt is index + the sequence's delta on all three axes; prompt tokens
    take their precomputed positions."""
    deltas = np.fromiter((s.seq.prompt.mrope_delta for s in batch), np.int64, len(batch))
    out = np.repeat((index + deltas[token_seq])[None], 3, axis=0)
    for i, s in enumerate(batch):
        prompt = s.seq.prompt.mrope_positions
        if s.start < prompt.shape[1]:
            hi = min(s.end, prompt.shape[1])
            out[:, cu[i]:cu[i] + hi - s.start] = prompt[:, s.start:hi]
    return out


def feed_indices(batch: list[ScheduledSeq], cu: np.ndarray, feed: Launched | None) -> dict:
    """Rows of the step whose input token is a placeholder for a token the previous step is still sampling, and
    that token's row in the previous step's output."""
    rows, src = [], []
    if feed is not None:
        where = {id(seq): i for i, seq in enumerate(feed.seqs)}
        for i, s in enumerate(batch):
            if s.seq.num_pending and s.end == len(s.seq):
                rows.append(cu[i + 1] - 1)
                src.append(where[id(s.seq)])
    return {"feed_rows": np.array(rows, dtype=np.int64), "feed_src": np.array(src, dtype=np.int64)}


def pad_tokens(host: dict, size: int) -> dict:
    """A step's per-token arrays padded to `size` rows that attend nowhere: no cache slot, outside every sequence's
    query range (attention reads only rows below cu_seqlens_q[-1])."""
    n = len(host["input_ids"])
    pad = size - n
    padded = dict(host)
    for name, value in (("input_ids", 0), ("slot_mapping", -1), ("token_seq", 0), ("token_pos", 0)):
        padded[name] = np.concatenate([host[name], np.full(pad, value, dtype=host[name].dtype)])
    padded["positions"] = np.pad(host["positions"], ((0, 0), (0, pad)))
    return padded


def padding_prefill(size: int, block_size: int) -> dict:
    """One sequence of `size` tokens that stores no KV (every slot -1): the step that records the prefill pieces."""
    blocks = -(-size // block_size)
    return {"input_ids": np.zeros(size, dtype=np.int64), "positions": np.zeros((3, size), dtype=np.int64),
            "slot_mapping": np.full(size, -1, dtype=np.int64), "cu_seqlens_q": np.array([0, size], dtype=np.int32),
            "seq_lens_k": np.array([size], dtype=np.int32), "block_tables": np.zeros((1, blocks), dtype=np.int32),
            "token_seq": np.zeros(size, dtype=np.int64), "token_pos": np.arange(size, dtype=np.int64),
            "logits_indices": np.array([size - 1], dtype=np.int64), "max_q": size, "max_k": size}


def staging_sizes(max_tokens: int, max_batch: int, max_blocks: int) -> dict:
    """Per-token arrays first: their offsets then depend only on the (padded) token count, which a graph fixes."""
    long, i32 = torch.long, torch.int32
    return {"input_ids": (max_tokens, long), "positions": (3 * max_tokens, long), "slot_mapping": (max_tokens, long),
            "token_seq": (max_tokens, long), "token_pos": (max_tokens, long), "cu_seqlens_q": (max_batch + 1, i32),
            "seq_lens_k": (max_batch, i32), "block_tables": (max_batch * max_blocks, i32),
            "logits_indices": (max_batch, long), "state_slots": (max_batch, long), "feed_rows": (max_batch, long),
            "feed_src": (max_batch, long)}
