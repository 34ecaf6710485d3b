"""Paged KV block pool with prefix caching.

A full block's key chains the previous block's key, its token ids and the content hashes of the media items that
place tokens inside it. Image placeholder tokens are all the same id, so the media hashes are what make the same
image hit and a different image miss.

Hybrid models (linear attention) also need the recurrent state at the end of the reused prefix: a prefix hit
there is the longest block match whose last block has a state snapshot (`StateSnapshots`), and prefills save
snapshots at the block boundaries worth reusing (`snapshot_points`).
"""
from collections import Counter, deque

import numpy as np
import xxhash

from .sequence import Sequence
from .state_snapshots import StateSnapshots


class Block:
    __slots__ = ("block_id", "ref_count", "key", "token_ids", "media")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.key: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.media: list[int] = []  # hashes of the media items with tokens in it, while it is in the cache


def block_key(prev: int, token_ids: list[int], media_hashes: list[int]) -> int:
    h = xxhash.xxh3_128()
    h.update(prev.to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for m in media_hashes:
        h.update(m.to_bytes(16, "little"))
    return h.intdigest()


def media_in_block(seq: Sequence, start: int, end: int) -> list[int]:
    spans = ((item.hash, *item.rows_in(start, end)) for item in seq.mm_items)
    return [media_hash for media_hash, lo, hi in spans if lo < hi]


def snapshot_points(seq: Sequence, block_size: int) -> list[int]:
    """Block boundaries of the prompt where a hybrid model saves its state: the last boundary inside or at the end
    of each media item (a shared system prompt + image asked different questions: the block after the image
    already holds the question) and the last boundary a prompt can reuse (the same prompt again, or the next
    turn of a chat)."""
    last = (seq.num_prompt_tokens - 1) // block_size * block_size
    media_ends = [(int(item.positions[-1]) + 1) // block_size * block_size for item in seq.mm_items]
    return sorted({p for p in media_ends + [last] if 0 < p <= last})


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool,
                 snapshots: StateSnapshots | None = None):
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.snapshots = snapshots if enable_reuse else None
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block id, for computed full blocks
        self.media_blocks: Counter[int] = Counter()  # media hash -> cached blocks holding its tokens
        self.hit_tokens = 0
        self.queried_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def holds_media(self, media_hash: int) -> bool:
        """Whether cached blocks hold tokens of this media item: a prompt with it may hit the prefix cache."""
        return media_hash in self.media_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def key_of(self, seq: Sequence, index: int) -> int:
        """Chained key of `seq`'s full block `index`, memoised on the sequence."""
        while len(seq.block_keys) <= index:
            i = len(seq.block_keys)
            start, end = i * self.block_size, (i + 1) * self.block_size
            prev = seq.block_keys[-1] if seq.block_keys else 0
            seq.block_keys.append(block_key(prev, seq.token_ids[start:end], media_in_block(seq, start, end)))
        return seq.block_keys[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids caching `seq`'s longest computed prefix; the last prompt token is always left to compute."""
        hits = []
        if not self.enable_reuse:
            return hits
        for i in range((len(seq) - 1) // self.block_size):
            block_id = self.cached.get(self.key_of(seq, i))
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        if self.snapshots is not None:
            while hits and self.snapshot_slot(seq, len(hits)) is None:
                hits.pop()
        return hits

    def snapshot_slot(self, seq: Sequence, num_blocks: int) -> int | None:
        """The snapshot slot holding the state after `seq`'s first `num_blocks` blocks, if saved."""
        return self.snapshots.lookup(self.key_of(seq, num_blocks - 1))

    def plan_snapshots(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        """(tokens into the chunk [start, end), snapshot slot) for each snapshot point the chunk computes."""
        if self.snapshots is None or start >= seq.num_prompt_tokens:
            return []
        plan = []
        for p in snapshot_points(seq, self.block_size):
            if start < p <= end:
                key = self.key_of(seq, p // self.block_size - 1)
                slot = self.snapshots.reserve(key)
                if slot is not None:
                    seq.pending_snapshots.append(key)
                    plan.append((p - start, slot))
        return plan

    def allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Admit `seq`: reuse its cached prefix `hits` and reserve blocks for its first chunk.

        False, with nothing taken, if the pool is short."""
        cached_tokens = len(hits) * self.block_size
        fresh = self.blocks_needed(cached_tokens + num_new_tokens) - len(hits)
        reusable_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if fresh + reusable_free > self.num_free_blocks:
            return False
        for block_id in hits:
            self.take(block_id)
        seq.block_table = hits + [self.take_free() for _ in range(fresh)]
        seq.num_cached_tokens = seq.num_computed_tokens = cached_tokens
        self.queried_tokens += seq.num_prompt_tokens
        self.hit_tokens += cached_tokens
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens` tokens. False if the pool is short."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            return False
        seq.block_table.extend(self.take_free() for _ in range(max(need, 0)))
        return True

    def take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_ids.remove(block_id)
        block.ref_count += 1

    def take_free(self) -> int:
        block = self.blocks[self.free_ids.popleft()]
        if block.key is not None and self.cached.get(block.key) == block.block_id:
            del self.cached[block.key]  # evict: the least recently freed cached block is reused first
            for media_hash in block.media:
                self.media_blocks[media_hash] -= 1
                if not self.media_blocks[media_hash]:
                    del self.media_blocks[media_hash]
        block.key, block.token_ids, block.media = None, (), []
        block.ref_count = 1
        return block.block_id

    def commit(self, seq: Sequence) -> None:
        """Publish the sequence's newly computed full blocks (and state snapshots) to the prefix cache."""
        if not self.enable_reuse:
            return
        for key in seq.pending_snapshots:
            self.snapshots.publish(key)
        seq.pending_snapshots.clear()
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.key is not None:
                continue
            block.key = self.key_of(seq, i)
            block.token_ids = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if self.cached.setdefault(block.key, block.block_id) == block.block_id:
                block.media = media_in_block(seq, i * self.block_size, (i + 1) * self.block_size)
                self.media_blocks.update(block.media)

    def free(self, seq: Sequence) -> None:
        for key in seq.pending_snapshots:
            self.snapshots.drop(key)
        seq.pending_snapshots.clear()
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
