"""Prefix-cache snapshots of linear-attention state for hybrid models, in an LRU over the state pool's snapshot
slots.

Attention KV can be reused from any block boundary, but a linear-attention layer's state after a prefix exists
only where it was saved. A snapshot is the state after a full block, keyed by that block's chained prefix-cache
key (tokens + media hashes, so a different image never matches). It is written during the forward that
computes its block and becomes visible only after that step commits.
"""
from collections import OrderedDict, deque


class StateSnapshots:
    def __init__(self, slots: range):
        self.free: deque[int] = deque(slots)
        self.ready: OrderedDict[int, int] = OrderedDict()  # key -> slot, least recently used first
        self.pending: dict[int, int] = {}  # key -> slot being written by the current step
        self.capacity = len(slots)

    def lookup(self, key: int) -> int | None:
        slot = self.ready.get(key)
        if slot is not None:
            self.ready.move_to_end(key)
        return slot

    def reserve(self, key: int) -> int | None:
        """A slot for the step to save `key`'s snapshot into; None when it exists or is already being saved."""
        if key in self.ready or key in self.pending:
            return None
        if self.free:
            slot = self.free.popleft()
        elif self.ready:
            _, slot = self.ready.popitem(last=False)
        else:
            return None
        self.pending[key] = slot
        return slot

    def publish(self, key: int) -> None:
        self.ready[key] = self.pending.pop(key)

    def drop(self, key: int) -> None:
        """Forget a snapshot whose step never completed."""
        self.free.append(self.pending.pop(key))
