"""Turns a scheduled batch into flat device tensors, runs the LM and samples the rows that need a token."""
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.attention import Attention
from ..layers.forward_context import AttentionMetadata, ForwardContext, StateMetadata, set_context, reset_context
from ..layers.gated_deltanet import GatedDeltaNet
from ..utils.h2d import async_tensor_h2d
from ..utils.nvtx import nvtx_range
from .encoder_runner import StepMedia
from .sampler import gather_logprobs, sample
from .scheduler import ScheduledSeq


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return sum(2 * m.num_kv_heads * m.head_dim for m in layers) * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 max_num_tokens: int):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
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

    def build(self, batch: list[ScheduledSeq]):
        """Host-side step inputs, all numpy: one H2D per array afterwards."""
        bs = self.block_size
        lens = np.array([s.num_tokens for s in batch])
        ids = np.concatenate([s.seq.token_ids[s.start:s.end] for s in batch])
        positions = np.concatenate([s.seq.positions(s.start, s.end) for s in batch], axis=1)
        slots = []
        max_blocks = max(len(s.seq.block_table) for s in batch)
        tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for i, s in enumerate(batch):
            table = np.asarray(s.seq.block_table, dtype=np.int64)
            tables[i, :len(table)] = table
            j = np.arange(s.start, s.end)
            slots.append(table[j // bs] * bs + j % bs)
        cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
        samples = np.array([s.samples for s in batch])
        state = {}
        if self.hybrid:
            state = {"state_slots": np.array([s.seq.state_slot for s in batch], dtype=np.int64),
                     "has_state": np.array([s.start > 0 for s in batch])}
        return {
            **state, "input_ids": ids, "positions": positions, "slot_mapping": np.concatenate(slots),
            "cu_seqlens_q": cu, "seq_lens_k": np.array([s.end for s in batch], dtype=np.int32),
            "block_tables": tables, "token_seq": np.repeat(np.arange(len(batch)), lens),
            "token_pos": np.concatenate([np.arange(n) for n in lens]), "logits_indices": cu[1:][samples] - 1,
            "max_q": int(lens.max()), "max_k": max(s.end for s in batch),
        }

    def upload(self, host: dict) -> tuple[dict, AttentionMetadata]:
        dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}
        dev = {k: async_tensor_h2d(v, dtypes.get(v.dtype, torch.long), self.device)
               for k, v in host.items() if isinstance(v, np.ndarray)}
        meta = AttentionMetadata(dev["cu_seqlens_q"], dev["seq_lens_k"], dev["block_tables"], dev["slot_mapping"],
                                 dev["token_seq"], dev["token_pos"], host["max_q"], host["max_k"], self.block_size)
        return dev, meta

    def state_metadata(self, batch: list[ScheduledSeq], host: dict, dev: dict) -> StateMetadata | None:
        if not self.hybrid:
            return None
        return StateMetadata(dev["state_slots"], dev["has_state"], [s.num_tokens for s in batch],
                             host["state_slots"].tolist(), [s.start == 0 for s in batch],
                             [s.snapshots for s in batch])

    def embed(self, input_ids: torch.Tensor, media: StepMedia | None) -> torch.Tensor | None:
        if media is None:
            return None
        embeds = self.model.embed(input_ids)
        embeds.index_copy_(0, media.rows, media.embeds.to(embeds.dtype))
        return embeds

    def step_deepstack(self, n: int, media: StepMedia | None) -> torch.Tensor | None:
        if media is None or media.deepstack is None:
            return None
        buf = self.deepstack[:, :n]
        buf.zero_()
        buf.index_copy_(1, media.rows, media.deepstack.to(buf.dtype))
        return buf

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], media: StepMedia | None) -> list[SampledToken]:
        with nvtx_range("prepare"):
            host = self.build(batch)
            dev, meta = self.upload(host)
            n = len(host["input_ids"])
            set_context(ForwardContext(meta, self.step_deepstack(n, media), self.state_metadata(batch, host, dev)))
            embeds = self.embed(dev["input_ids"], media)
        try:
            with nvtx_range("forward"):
                hidden = self.model(dev["positions"], input_ids=None if embeds is not None else dev["input_ids"],
                                    inputs_embeds=embeds)
                logits = self.model.compute_logits(hidden[dev["logits_indices"]]).float()
        finally:
            reset_context()
        with nvtx_range("sample"):
            return self.sample(logits, [s.seq for s in batch if s.samples])

    def sample(self, logits: torch.Tensor, seqs) -> list[SampledToken]:
        if not seqs:
            return []
        tokens = sample(logits, seqs)
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if not want:
            return [SampledToken(t) for t in tokens.tolist()]
        chosen, top_ids, top_values = gather_logprobs(logits, tokens, max(want))
        out = []
        for seq, t, lp, ids, vals in zip(seqs, tokens.tolist(), chosen.tolist(), top_ids.tolist(),
                                         top_values.tolist()):
            k = seq.params.logprobs or 0
            out.append(SampledToken(t, lp, dict(zip(ids[:k], vals[:k]))))
        return out
