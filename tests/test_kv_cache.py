"""BlockManager: block accounting, prefix caching with media hashes, eviction, and all-or-nothing allocation."""
import numpy as np
import torch

from trtllm_qwenvl.engine.kv_cache import BlockManager, block_key, media_in_block
from trtllm_qwenvl.engine.sequence import MMItem, ProcessedPrompt, Sequence
from trtllm_qwenvl.inputs.mrope import text_positions
from trtllm_qwenvl.llmapi.sampling_params import SamplingParams

BS = 4  # tokens per block
IMG = 9999  # placeholder id: identical for every image, so only the media hash tells images apart


def make_seq(tokens, mm_items=()) -> Sequence:
    prompt = ProcessedPrompt(list(tokens), list(mm_items), text_positions(len(tokens)), 0)
    return Sequence("r", prompt, SamplingParams())


def image(start, count, hash_):
    return MMItem("image", torch.empty(0), None, (1, 2, 2), np.arange(start, start + count), hash_)


def run_and_cache(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` whole, mark it fully computed, publish its blocks and free it. -> its block table."""
    assert bm.allocate(seq, bm.match_prefix(seq), len(seq) - len(bm.match_prefix(seq)) * BS)
    table = list(seq.block_table)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    bm.free(seq)
    return table


# ---- accounting --------------------------------------------------------------------------------------------
def test_allocate_grow_free_restores_free_count():
    bm = BlockManager(8, BS, enable_reuse=False)
    seq = make_seq(range(6))
    assert bm.allocate(seq, [], 6)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.grow(seq, 12) and len(seq.block_table) == 3, "12 tokens still fit in 3 blocks"
    assert len(set(seq.block_table)) == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_grow_fails_without_taking_when_short():
    bm = BlockManager(3, BS, enable_reuse=False)
    seq = make_seq(range(4))
    assert bm.allocate(seq, [], 4)
    assert not bm.grow(seq, 4 * BS)  # needs 3 more, 2 free
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 2


def test_allocate_fails_and_takes_nothing_when_pool_short():
    bm = BlockManager(3, BS, enable_reuse=False)
    a, b = make_seq(range(8)), make_seq(range(100, 108))
    assert bm.allocate(a, [], 8)
    assert not bm.allocate(b, [], 8)
    assert bm.num_free_blocks == 1 and b.block_table == []


def test_shared_prefix_blocks_are_freed_only_by_last_user():
    bm = BlockManager(8, BS, enable_reuse=True)
    run_and_cache(bm, make_seq(range(9)))
    a, b = make_seq(range(9)), make_seq(range(9))
    for s in (a, b):
        hits = bm.match_prefix(s)
        assert bm.allocate(s, hits, len(s) - len(hits) * BS)
    assert a.block_table[:2] == b.block_table[:2], "both should share the two cached blocks"
    assert bm.num_free_blocks == 8 - 2 - 2  # 2 shared + 1 private each
    bm.free(a)
    assert bm.num_free_blocks == 5
    bm.free(b)
    assert bm.num_free_blocks == 8


# ---- prefix caching ----------------------------------------------------------------------------------------
def test_prefix_hit_never_covers_last_prompt_token():
    bm = BlockManager(16, BS, enable_reuse=True)
    first = run_and_cache(bm, make_seq(range(2 * BS)))
    hits = bm.match_prefix(make_seq(range(2 * BS)))  # exactly 2 blocks: the last token must be recomputed
    assert hits == first[:1]


def test_prefix_hit_covers_all_full_blocks_when_a_token_follows():
    bm = BlockManager(16, BS, enable_reuse=True)
    first = run_and_cache(bm, make_seq(range(2 * BS + 1)))
    seq = make_seq(list(range(2 * BS)) + [77, 78])
    hits = bm.match_prefix(seq)
    assert hits == first[:2]
    assert bm.allocate(seq, hits, len(seq) - 2 * BS)
    assert seq.block_table[:2] == first[:2]
    assert seq.num_computed_tokens == seq.num_cached_tokens == 2 * BS


def test_prefix_hit_stops_at_first_differing_block():
    bm = BlockManager(16, BS, enable_reuse=True)
    first = run_and_cache(bm, make_seq(range(3 * BS + 1)))
    tokens = list(range(3 * BS + 1))
    tokens[BS + 1] = 555  # block 1 differs; block 2 equal again but its chained key differs
    assert bm.match_prefix(make_seq(tokens)) == first[:1]


def test_partial_or_uncomputed_blocks_are_not_cached():
    bm = BlockManager(16, BS, enable_reuse=True)
    seq = make_seq(range(3 * BS + 1))
    assert bm.allocate(seq, [], len(seq))
    seq.num_computed_tokens = BS + 2  # only block 0 is full and computed
    bm.commit(seq)
    bm.free(seq)
    assert len(bm.match_prefix(make_seq(range(3 * BS + 1)))) == 1


def test_different_image_misses_blocks_containing_it_but_hits_before():
    bm = BlockManager(16, BS, enable_reuse=True)
    tokens = [1, 2, 3, 4, 5] + [IMG] * 4 + [6, 7, 8, 9]  # image at positions 5..8: blocks 1 and 2
    first = run_and_cache(bm, make_seq(tokens, [image(5, 4, hash_=111)]))
    assert bm.match_prefix(make_seq(tokens, [image(5, 4, hash_=222)])) == first[:1]
    assert bm.match_prefix(make_seq(tokens, [image(5, 4, hash_=111)])) == first[:3]


def test_media_in_block_finds_items_overlapping_the_range():
    seq = make_seq([0] * 16, [image(5, 4, 111), image(12, 2, 222)])
    assert media_in_block(seq, 0, 4) == []
    assert media_in_block(seq, 4, 8) == [111]
    assert media_in_block(seq, 8, 12) == [111]
    assert media_in_block(seq, 12, 16) == [222]


def test_block_key_depends_on_prev_tokens_and_media():
    base = block_key(0, [1, 2, 3, 4], [])
    assert base == block_key(0, [1, 2, 3, 4], [])
    assert base != block_key(1, [1, 2, 3, 4], [])
    assert base != block_key(0, [1, 2, 3, 5], [])
    assert base != block_key(0, [1, 2, 3, 4], [7])
    assert block_key(0, [1, 2, 3, 4], [7]) != block_key(0, [1, 2, 3, 4], [8])


def test_reuse_disabled_never_hits():
    bm = BlockManager(16, BS, enable_reuse=False)
    run_and_cache(bm, make_seq(range(3 * BS + 1)))
    assert bm.match_prefix(make_seq(range(3 * BS + 1))) == []
    assert bm.cached == {}


# ---- eviction ----------------------------------------------------------------------------------------------
def test_reallocated_cached_blocks_are_evicted():
    bm = BlockManager(3, BS, enable_reuse=True)
    run_and_cache(bm, make_seq(range(3 * BS)))
    other = make_seq(range(500, 500 + 3 * BS))
    assert bm.allocate(other, [], 3 * BS)  # pool exhausted: every cached block is reused
    assert bm.match_prefix(make_seq(range(3 * BS))) == [], "stale hit on a block now holding other tokens"
    other.num_computed_tokens = 3 * BS
    bm.commit(other)
    bm.free(other)
    assert bm.match_prefix(make_seq(range(3 * BS))) == []


def test_partial_reallocation_evicts_tail_first_and_keeps_head_hits():
    bm = BlockManager(4, BS, enable_reuse=True)
    first = run_and_cache(bm, make_seq(range(3 * BS)))  # 3 cached blocks, 1 never used
    other = make_seq(range(500, 500 + 2 * BS))
    assert bm.allocate(other, [], 2 * BS)  # takes the unused block and one cached block
    hits = bm.match_prefix(make_seq(range(3 * BS + 1)))
    assert hits == first[:2], "the freed sequence's tail block should be evicted before its head"
    assert first[2] in other.block_table


def test_allocate_with_hits_fails_and_takes_nothing_when_pool_short():
    bm = BlockManager(3, BS, enable_reuse=True)
    run_and_cache(bm, make_seq(range(2 * BS + 1)))
    seq = make_seq(list(range(2 * BS)) + list(range(900, 900 + 2 * BS)))
    hits = bm.match_prefix(seq)
    assert len(hits) == 2
    assert not bm.allocate(seq, hits, 2 * BS)  # 2 cached (free) + 2 fresh > 3 blocks
    assert bm.num_free_blocks == 3 and seq.block_table == []
    assert bm.match_prefix(make_seq(seq.token_ids)) == hits, "a failed allocate must not evict the cache"


def test_holds_media_while_a_cached_block_has_its_tokens():
    bm = BlockManager(4, BS, enable_reuse=True)
    run_and_cache(bm, make_seq([1, IMG, IMG, 2, 3, 4, 5, 6, 7], [image(1, 2, hash_=42)]))
    assert bm.holds_media(42) and not bm.holds_media(43)
    for _ in range(bm.num_blocks):  # every cached block evicted for new work
        bm.take_free()
    assert not bm.holds_media(42)
