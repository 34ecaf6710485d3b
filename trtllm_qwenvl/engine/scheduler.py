"""Continuous batching: decodes and unfinished prefills first, then new requests, under the step's token budget.

Hybrid models also hold a state slot per running sequence: taken at admission (with the cached prefix's state
snapshot copied in), returned on finish, abort or preemption."""
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockManager
from .sequence import Sequence, Status
from .state_pool import StatePool


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int       # first token computed this step
    num_tokens: int  # tokens computed this step
    # Hybrid models: (tokens into this chunk, snapshot slot) where the step also saves the state.
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so the step samples its next one."""
        return self.end == len(self.seq)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_tokens: int, chunked_prefill: bool,
                 states: StatePool | None = None):
        self.blocks = blocks
        self.states = states
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_tokens
        batch = []
        for seq in list(self.running):
            if seq not in self.running or budget == 0 or seq.last_token_in_flight:
                continue
            n = min(len(seq) - seq.num_computed_tokens, budget)
            if not self.reserve(seq, seq.num_computed_tokens + n):
                continue
            batch.append(self.plan(seq, seq.num_computed_tokens, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            item = self.admit(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            batch.append(item)
            budget -= item.num_tokens
        return batch

    def admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        if seq.num_pending:  # preempted while its next token was in flight: prefill it once that token is known
            return None
        hits = self.blocks.match_prefix(seq)
        n = len(seq) - len(hits) * self.blocks.block_size
        if n > budget and not self.chunked_prefill:
            return None
        n = min(n, budget)
        if not self.blocks.allocate(seq, hits, n):
            return None
        if self.states is not None:
            seq.state_slot = self.states.allocate()
            if hits:
                self.states.copy(self.blocks.snapshot_slot(seq, len(hits)), seq.state_slot)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return self.plan(seq, seq.num_computed_tokens, n)

    def plan(self, seq: Sequence, start: int, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, start, n, self.blocks.plan_snapshots(seq, start, start + n))

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s blocks, preempting the newest running sequences while the pool is short."""
        while not self.blocks.grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s KV and requeue it first; its generated tokens are recomputed as part of its prompt."""
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED

    def release(self, seq: Sequence) -> None:
        """Return the sequence's KV blocks and state slot."""
        self.blocks.free(seq)
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None
