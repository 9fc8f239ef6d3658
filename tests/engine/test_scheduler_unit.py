"""Scheduler policy without a model: sequences, a real BlockAllocator, and
made-up sampled tokens landed through `update_from_output` as the engine does."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.engine.core.block_manager import BlockAllocator
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.core.sequence import Sequence, SequenceStatus
from tokenmill.engine.outputs import RequestMetrics
from tokenmill.engine.runner_output import ModelRunnerOutput
from tokenmill.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

EOS = 0
TOKEN = 5  # a sampled token that is not EOS
_ids = itertools.count()


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 1024,
    prefix_caching: bool = False,
    policy: str = "fcfs",
) -> Scheduler:
    allocator = BlockAllocator(num_blocks + 1, block_size, prefix_caching)  # (+1: the zero block)
    return Scheduler(allocator, max_num_seqs, budget, max_model_len, eos_token_ids=[EOS], policy=policy)


def make_seq(
    prompt_len: int, max_tokens: int = 100, first_token: int = 10, priority: int = 0, arrival: float = 0.0, **params
) -> Sequence:
    seq_id = next(_ids)
    prompt = tuple(range(first_token, first_token + prompt_len))
    return Sequence(
        seq_id,
        f"req-{seq_id}",
        0,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        RequestMetrics(arrival_time=arrival),
        priority=priority,
    )


def land(
    scheduler: Scheduler, step: SchedulerOutput, token: int = TOKEN, per_seq: dict[int, int] | None = None
) -> None:
    """Land `token` for every sampled row, or the token `per_seq` gives a sequence's id."""
    per_seq = per_seq or {}
    scheduler.update_from_output(step, ModelRunnerOutput([per_seq.get(i.seq.seq_id, token) for i in step.sampled]))


def step(scheduler: Scheduler, token: int = TOKEN) -> dict[int, int]:
    """Schedule and land one step; the tokens each sequence ran, by seq id."""
    out = scheduler.schedule()
    land(scheduler, out, token)
    return {item.seq.seq_id: item.num_new_tokens for item in out.all}


def test_token_budget_is_respected_and_prompts_are_chunked_to_fit():
    s = make_scheduler(budget=16)
    a, b, c = make_seq(10), make_seq(10), make_seq(10)
    for seq in (a, b, c):
        s.add(seq)
    assert step(s) == {a.seq_id: 10, b.seq_id: 6}  # b's prompt cut to the budget, c not admitted
    # a decodes one token, b finishes its prompt, c starts within what is left.
    assert step(s) == {a.seq_id: 1, b.seq_id: 4, c.seq_id: 10}
    for _ in range(5):
        out = s.schedule()
        assert 0 < out.num_tokens <= 16
        land(s, out)


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_after_the_last_chunk():
    s = make_scheduler(budget=16)
    seq = make_seq(40)
    s.add(seq)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        (item,) = out.all
        chunks.append((item.num_computed_before, item.num_new_tokens, item.samples))
        land(s, out)
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert seq.output_token_ids == [TOKEN] and seq.num_computed_tokens == 40
    out = s.schedule()
    assert [(i.seq, i.num_new_tokens) for i in out.decodes] == [(seq, 1)] and not out.prefills


def test_admission_is_fifo_and_capped_by_max_num_seqs():
    s = make_scheduler(max_num_seqs=2, budget=1000)
    seqs = [make_seq(4, max_tokens=2) for _ in range(5)]
    for seq in seqs:
        s.add(seq)
    assert list(step(s)) == [seqs[0].seq_id, seqs[1].seq_id]
    assert s.running == seqs[:2] and list(s.waiting) == seqs[2:]
    # seqs 0 and 1 end with their second token (max_tokens=2); the next two are admitted in order.
    step(s)
    assert seqs[0].finish_reason == seqs[1].finish_reason == "length"
    assert list(step(s)) == [seqs[2].seq_id, seqs[3].seq_id]
    assert list(s.waiting) == [seqs[4]]


def test_running_sequences_go_before_new_prefills():
    s = make_scheduler(budget=8)
    old = make_seq(4)
    s.add(old)
    step(s)
    new = make_seq(20)
    s.add(new)
    out = s.schedule()
    # The decode takes its token first; the newcomer gets the rest of the budget.
    assert [(i.seq, i.num_new_tokens) for i in out.decodes] == [(old, 1)]
    assert [(i.seq, i.num_new_tokens) for i in out.prefills] == [(new, 7)]
    land(s, out)
    # A running sequence still prefilling also goes before a newer arrival.
    newest = make_seq(4)
    s.add(newest)
    assert step(s) == {old.seq_id: 1, new.seq_id: 7}


def test_preemption_evicts_the_newest_running_sequence_and_frees_its_blocks():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64)
    older, newer = make_seq(15), make_seq(12)  # 4 blocks and 3 blocks; one block left
    s.add(older)
    s.add(newer)
    step(s)
    assert s.allocator.num_free == 1
    step(s)  # older reaches 16 tokens (its 4 blocks), newer takes the last block for its 13th
    assert s.allocator.num_free == 0 and len(newer.block_table) == 4
    # older needs a 5th block: the newest running sequence is preempted, not older.
    out = s.schedule()
    assert [i.seq for i in out.all] == [older]
    assert s.num_preemptions == 1
    assert newer.status is SequenceStatus.WAITING and s.waiting[0] is newer
    assert newer.block_table == [] and newer.num_computed_tokens == 0
    assert s.allocator.num_free == 3  # newer's 4 blocks back, one taken by older
    assert newer.output_token_ids == [TOKEN, TOKEN]  # generated tokens are kept for the recomputation
    land(s, out, token=EOS)  # older stops: its blocks free, newer is readmitted
    assert older.finish_reason == "stop" and s.allocator.num_free == 8
    out = s.schedule()
    (item,) = out.all
    assert item.seq is newer and item.num_new_tokens == 14 and item.samples  # prompt + outputs recomputed


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    s = make_scheduler(num_blocks=2, block_size=4, budget=64)
    seq = make_seq(8)  # both blocks
    s.add(seq)
    step(s)
    out = s.schedule()
    assert not out and s.num_preemptions == 1 and s.waiting[0] is seq and s.allocator.num_free == 2


def test_priority_policy_admits_by_priority_then_arrival():
    s = make_scheduler(max_num_seqs=1, budget=1000, policy="priority")
    late_urgent = make_seq(4, max_tokens=1, priority=-1, arrival=3.0)
    early_batch = make_seq(4, max_tokens=1, priority=5, arrival=1.0)
    early_normal, late_normal = make_seq(4, max_tokens=1, arrival=1.0), make_seq(4, max_tokens=1, arrival=2.0)
    for seq in (early_batch, late_normal, early_normal, late_urgent):
        s.add(seq)
    assert list(s.waiting) == [late_urgent, early_normal, late_normal, early_batch]
    order = [next(iter(step(s))) for _ in range(4)]  # one admitted a step; max_tokens=1 ends it there
    assert order == [seq.seq_id for seq in (late_urgent, early_normal, late_normal, early_batch)]


def test_priority_policy_preempts_the_lowest_priority_running_sequence():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, policy="priority")
    important, background = make_seq(12, priority=0, arrival=2.0), make_seq(15, priority=9, arrival=1.0)
    s.add(background)  # older, but of lower priority: the one to go when blocks run out
    s.add(important)
    step(s)
    step(s)
    assert s.allocator.num_free == 0
    out = s.schedule()  # background needs a 5th block: it is the lowest priority, so it goes itself
    assert [i.seq for i in out.all] == [important]
    assert background.status is SequenceStatus.WAITING and s.num_preemptions == 1


def test_fcfs_preempts_the_newest_even_when_priorities_differ():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64)
    older, newer = make_seq(15, priority=9), make_seq(12, priority=0)  # priorities: ignored under fcfs
    s.add(older)
    s.add(newer)
    step(s)
    step(s)
    s.schedule()
    assert newer.status is SequenceStatus.WAITING and older.status is SequenceStatus.RUNNING


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        make_scheduler(policy="lifo")


def test_watermark_keeps_blocks_free_for_running_sequences_only_when_some_run():
    s = make_scheduler(num_blocks=4, block_size=4)
    assert s.watermark_blocks == 1
    assert make_scheduler(num_blocks=300).watermark_blocks == 3  # 1% of the blocks
    running = make_seq(3)  # one block, still enough after its first token
    s.add(running)
    step(s)
    waiting = make_seq(12)  # 3 blocks: exactly the free ones, but one must stay free
    s.add(waiting)
    assert step(s) == {running.seq_id: 1}
    assert s.waiting[0] is waiting and s.allocator.num_free == 3
    # With nothing running, the same admission may take every block.
    empty = make_scheduler(num_blocks=4, block_size=4)
    whole = make_seq(16)
    empty.add(whole)
    assert step(empty) == {whole.seq_id: 16} and empty.allocator.num_free == 0


def test_update_from_output_advances_and_finishes_on_eos_max_tokens_and_stop_ids():
    s = make_scheduler(num_blocks=32)
    eos, capped, stopped, ignoring = (
        make_seq(4),
        make_seq(4, max_tokens=3),
        make_seq(4, stop_token_ids=[42]),
        make_seq(4, max_tokens=2, ignore_eos=True),
    )
    for seq in (eos, capped, stopped, ignoring):
        s.add(seq)
    out = s.schedule()
    assert all(seq.output_token_ids[-1] < 0 for seq in (eos, capped, stopped, ignoring))  # placeholders
    land(s, out, per_seq={stopped.seq_id: 42, ignoring.seq_id: EOS})
    assert stopped.finish_reason == "stop" and stopped.stop_reason == 42 and stopped.block_table == []
    assert not ignoring.is_finished and ignoring.output_token_ids == [EOS]  # ignore_eos
    assert eos.output_token_ids == [TOKEN] and eos.num_computed_tokens == 4 and not eos.is_finished
    land(s, s.schedule(), per_seq={eos.seq_id: EOS})
    assert eos.finish_reason == "stop" and eos.output_token_ids == [TOKEN, EOS]
    assert ignoring.finish_reason == "length"
    assert s.running == [capped]
    out = s.schedule()
    assert capped.finishing  # its third token ends it: the scheduler plans nothing more for it
    land(s, out)
    assert capped.finish_reason == "length" and capped.output_token_ids == [TOKEN] * 3
    assert s.running == [] and s.allocator.num_free == 32
    assert sorted(s.take_released()) == sorted(seq.seq_id for seq in (eos, capped, stopped, ignoring))
    assert not s.schedule()
