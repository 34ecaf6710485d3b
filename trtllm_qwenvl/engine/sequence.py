"""A request as the engine sees it: tokens, multimodal items, mRoPE positions, KV blocks, state slot and
progress."""
import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np
import torch

from ..inputs.pixels import DevicePatchify, PixelNorm
from ..llmapi.sampling_params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class MMItem:
    """One image or video after the HF processor: raw pixels, which `norm` turns into the processor's pixels on the
    encoder's device (after `patchify`, where the item holds an image the device patchifies). `positions` are the
    prompt indices its embeddings fill (none yet when it is announced for an early encode, before the prompt is
    tokenized)."""
    modality: str
    pixel_values: torch.Tensor
    norm: PixelNorm
    grid_thw: tuple[int, int, int]
    positions: np.ndarray
    hash: int
    patchify: DevicePatchify | None = None

    def patches(self) -> torch.Tensor:
        """Raw patch rows on the host (the encoder patchifies on its device, a run of items at once)."""
        return self.patchify(self.pixel_values[None]) if self.patchify is not None else self.pixel_values

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """Its embedding rows [lo, hi) whose tokens fall in the prompt range [start, end) (positions ascend)."""
        return int(np.searchsorted(self.positions, start)), int(np.searchsorted(self.positions, end))


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    mm_items: list[MMItem] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None  # (3, L)
    mrope_delta: int = 0
    prompt: str | None = None


_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.mm_items = prompt.mm_items
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_keys: list[int] = []  # chained prefix-cache keys of this sequence's full blocks
        self.state_slot: int | None = None  # linear-attention state slot (hybrid models), while running
        self.pending_snapshots: list[int] = []  # keys of state snapshots the current step saves
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Overlap scheduler: the last token is a placeholder while the step that samples it runs (0 or 1), and a
        # sequence whose in-flight token is its last by length is not scheduled again.
        self.num_pending = 0
        self.last_token_in_flight = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.preprocess_time = 0.0
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
