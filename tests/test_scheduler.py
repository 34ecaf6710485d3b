"""Scheduler: batch and token limits, chunked prefill, preemption. Steps are simulated as the engine does."""
from trtllm_qwenvl.engine.kv_cache import BlockManager
from trtllm_qwenvl.engine.scheduler import Scheduler
from trtllm_qwenvl.engine.sequence import ProcessedPrompt, Sequence, Status
from trtllm_qwenvl.inputs.mrope import text_positions
from trtllm_qwenvl.llmapi.sampling_params import SamplingParams


def make_seq(n: int, first: int = 0) -> Sequence:
    tokens = list(range(first, first + n))
    return Sequence(f"r{first}", ProcessedPrompt(tokens, [], text_positions(n), 0), SamplingParams())


def make_scheduler(num_blocks=64, block_size=4, batch=8, tokens=64, chunked=False, reuse=False):
    return Scheduler(BlockManager(num_blocks, block_size, reuse), batch, tokens, chunked)


def step(sched: Scheduler, batch) -> None:
    """What LLMEngine.postprocess does: advance progress, commit blocks, append a token where it samples."""
    for item in batch:
        item.seq.num_computed_tokens = item.end
        sched.blocks.commit(item.seq)
        if item.samples:
            item.seq.token_ids.append(7)


def plan(batch):
    return [(item.seq, item.start, item.num_tokens, item.samples) for item in batch]


# ---- continuous batching -----------------------------------------------------------------------------------
def test_batch_size_limit_holds_back_extra_requests():
    sched = make_scheduler(batch=2)
    a, b, c = make_seq(5, 0), make_seq(5, 100), make_seq(5, 200)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert plan(batch) == [(a, 0, 5, True), (b, 0, 5, True)]
    assert c.status == Status.WAITING and list(sched.waiting) == [c]
    step(sched, batch)
    assert plan(sched.schedule()) == [(a, 5, 1, True), (b, 5, 1, True)], "c must wait: the batch is full"
    sched.finish(a)
    batch = sched.schedule()
    assert [(i.seq, i.start, i.num_tokens) for i in batch] == [(b, 5, 1), (c, 0, 5)]


def test_token_budget_limits_new_prefills():
    sched = make_scheduler(tokens=10)
    a, b, c = make_seq(4, 0), make_seq(4, 100), make_seq(4, 200)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [i.seq for i in batch] == [a, b], "c's 4 tokens do not fit the 2 left of the budget"
    assert sum(i.num_tokens for i in batch) <= 10
    step(sched, batch)
    batch = sched.schedule()
    assert plan(batch) == [(a, 4, 1, True), (b, 4, 1, True), (c, 0, 4, True)]
    assert sum(i.num_tokens for i in batch) == 6


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(tokens=6)
    a = make_seq(5, 0)
    sched.add(a)
    step(sched, sched.schedule())
    b = make_seq(6, 100)
    sched.add(b)
    batch = sched.schedule()
    assert plan(batch) == [(a, 5, 1, True)], "b (6 tokens) cannot fit beside a's decode without chunking"
    assert b.status == Status.WAITING


def test_long_prompt_waits_without_chunked_prefill():
    sched = make_scheduler(tokens=8, chunked=False)
    seq = make_seq(12)
    sched.add(seq)
    assert sched.schedule() == []
    assert seq.status == Status.WAITING and seq.block_table == []
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_waiting_queue_is_fifo_behind_a_blocked_head():
    sched = make_scheduler(tokens=8, chunked=False)
    long, short = make_seq(12, 0), make_seq(3, 100)
    sched.add(long)
    sched.add(short)
    assert sched.schedule() == []
    assert list(sched.waiting) == [long, short]


# ---- chunked prefill ---------------------------------------------------------------------------------------
def test_chunked_prefill_splits_prompt_and_samples_only_at_the_end():
    sched = make_scheduler(tokens=4, chunked=True)
    seq = make_seq(10)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        batch = sched.schedule()
        assert len(batch) == 1
        chunks.append(plan(batch)[0][1:])
        step(sched, batch)
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert len(seq) == 11 and seq.num_output_tokens == 1
    assert plan(sched.schedule()) == [(seq, 10, 1, True)]


def test_chunked_prefill_shares_budget_with_decodes():
    sched = make_scheduler(tokens=5, chunked=True)
    a = make_seq(3, 0)
    sched.add(a)
    step(sched, sched.schedule())
    b = make_seq(9, 100)
    sched.add(b)
    seen = []
    while not b.output_token_ids:
        batch = sched.schedule()
        assert sum(i.num_tokens for i in batch) <= 5
        seen.append([(i.seq is b, i.start, i.num_tokens, i.samples) for i in batch])
        step(sched, batch)
    assert seen == [
        [(False, 3, 1, True), (True, 0, 4, False)],
        [(False, 4, 1, True), (True, 4, 4, False)],
        [(False, 5, 1, True), (True, 8, 1, True)],
    ]


def test_chunked_prefill_blocks_cover_each_chunk():
    sched = make_scheduler(block_size=4, tokens=5, chunked=True)
    seq = make_seq(13)
    sched.add(seq)
    while not seq.output_token_ids:
        batch = sched.schedule()
        assert len(seq.block_table) * 4 >= batch[0].end, "blocks must cover every token computed this step"
        step(sched, batch)


# ---- preemption --------------------------------------------------------------------------------------------
def test_out_of_blocks_preempts_newest_running_sequence():
    sched = make_scheduler(num_blocks=4, block_size=2, batch=4, tokens=32)
    a, b = make_seq(3, 0), make_seq(3, 100)
    sched.add(a)
    sched.add(b)
    step(sched, sched.schedule())  # prefill: 2 blocks each, pool empty
    step(sched, sched.schedule())  # decode to 4 tokens: still 2 blocks each
    c = make_seq(2, 200)
    sched.add(c)
    batch = sched.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert plan(batch) == [(a, 4, 1, True)]
    assert sched.num_preemptions == 1
    assert b.status == Status.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b, c], "the preempted sequence must be requeued at the front"
    assert sched.running == [a]
    assert sched.blocks.num_free_blocks == 1
    assert len(b) == 5, "generated tokens are kept and recomputed as prompt"


def test_preempted_sequence_resumes_with_full_recompute():
    sched = make_scheduler(num_blocks=4, block_size=2, batch=4, tokens=32)
    a, b = make_seq(3, 0), make_seq(3, 100)
    sched.add(a)
    sched.add(b)
    step(sched, sched.schedule())
    step(sched, sched.schedule())
    step(sched, sched.schedule())  # b preempted here
    sched.finish(a)
    assert sched.blocks.num_free_blocks == 4
    batch = sched.schedule()
    assert plan(batch) == [(b, 0, 5, True)]
    assert b.status == Status.RUNNING


def test_sequence_that_cannot_grow_preempts_itself_when_it_is_newest():
    sched = make_scheduler(num_blocks=2, block_size=2, batch=4, tokens=32)
    a = make_seq(3)
    sched.add(a)
    step(sched, sched.schedule())  # 2 blocks, len 4
    step(sched, sched.schedule())  # len 5: needs a 3rd block that does not exist
    assert sched.schedule() == []
    assert a.status == Status.WAITING and sched.num_preemptions == 1
    assert sched.blocks.num_free_blocks == 2


def test_finish_frees_blocks_of_running_and_waiting():
    sched = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_seq(5, 0), make_seq(50, 100)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a)
    sched.finish(b)
    assert a.status == b.status == Status.FINISHED
    assert not sched.has_work()
    assert sched.blocks.num_free_blocks == 8
