"""Block allocator and prefix cache without a model: hash chains, LRU eviction of freed cached
blocks, reference counts, the zero block, running out of blocks."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.engine.core.block_manager import BlockAllocator, block_hash
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.outputs import RequestMetrics
from tokenmill.engine.runner_output import ModelRunnerOutput
from tokenmill.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BLOCK = 4
_ids = itertools.count()


def chain(tokens: list[int]) -> list[int]:
    """Hashes of the full blocks of `tokens`, each over its parent's hash and its own tokens."""
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = block_hash(parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        hashes.append(parent)
    return hashes


def make_seq(prompt: list[int]) -> Sequence:
    seq_id = next(_ids)
    return Sequence(
        seq_id, f"req-{seq_id}", 0, tuple(prompt), SamplingParams(max_tokens=4), RequestMetrics(arrival_time=0.0)
    )


def make_scheduler(num_blocks: int = 16) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks + 1, BLOCK, True), 8, 256, 1024, eos_token_ids=[0])


def prefill_and_finish(s: Scheduler, prompt: list[int]) -> Sequence:
    """Run a prompt through one step (its full blocks get registered), then end it."""
    seq = make_seq(prompt)
    s.add(seq)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([7] * len(out.sampled)))
    s.finish(seq, "abort")
    return seq


def test_hash_chain_depends_on_every_earlier_block():
    common = list(range(100, 112))
    a, b = chain([1, 2, 3, 4] + common), chain([1, 2, 3, 5] + common)
    assert len(a) == len(b) == 4
    # One different token in the first block changes every later hash, though those blocks'
    # tokens are the same.
    assert all(x != y for x, y in zip(a, b))
    assert chain([1, 2, 3, 4] + common) == a  # and the same prefix hashes the same


def test_same_prefix_reuses_the_same_blocks_and_a_different_start_reuses_none():
    s = make_scheduler()
    prompt = list(range(10, 22))  # 3 full blocks
    first = make_seq(prompt)
    s.add(first)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([7]))
    blocks = list(first.block_table)
    assert first.block_hashes == chain(prompt)
    # A second request with the same first 8 tokens shares those two blocks while the first runs.
    second = make_seq(prompt[:8] + [90, 91, 92, 93, 94])
    s.add(second)
    s.schedule()
    assert second.block_table[:2] == blocks[:2] and second.block_table[2] not in blocks
    assert second.num_cached_tokens == 8 and s.allocator.ref_counts[blocks[0]] == 2
    # The same later tokens behind a different first block: nothing is reused.
    third = make_seq([99] + prompt[1:])
    s.add(third)
    s.schedule()
    assert third.num_cached_tokens == 0 and not set(third.block_table) & set(blocks)


def test_at_least_one_prompt_token_is_computed_even_when_all_blocks_are_cached():
    s = make_scheduler()
    prompt = list(range(10, 18))  # exactly 2 blocks
    prefill_and_finish(s, prompt)
    again = make_seq(prompt)
    s.add(again)
    (item,) = s.schedule().all
    # The last block is not taken from the cache: its last token's logits give the first output.
    assert again.num_cached_tokens == 4 and item.num_new_tokens == 4


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    a = BlockAllocator(7, BLOCK, enable_prefix_caching=True)
    blocks = [a.allocate() for _ in range(6)]
    for i, block in enumerate(blocks):
        a.register(block, 1000 + i)
    release_order = [2, 0, 5, 1, 3, 4]
    for i in release_order:
        a.release(blocks[i])
    # Freed blocks keep their hashes; allocating takes the least recently freed and evicts its hash.
    assert a.allocate() == blocks[2] and a.allocate() == blocks[0]
    assert a.lookup(1002) is None and a.lookup(1000) is None
    assert all(a.cached.get(1000 + i) == blocks[i] for i in (5, 1, 3, 4))
    # Reviving a freed block takes it off the free list; releasing it again makes it the most recent.
    revived = a.lookup(1005)
    assert revived == blocks[5] and a.ref_counts[revived] == 1 and revived not in a.free
    a.release(revived)
    assert list(a.free) == [blocks[1], blocks[3], blocks[4], blocks[5]]


def test_a_finished_sequence_frees_its_tail_blocks_first_so_its_prefix_stays_cached_longest():
    s = make_scheduler(num_blocks=4)
    prompt = list(range(10, 23))  # 3 full blocks and a partial one: every block of the cache
    seq = make_seq(prompt)
    s.add(seq)
    out = s.schedule()
    table = list(seq.block_table)
    s.update_from_output(out, ModelRunnerOutput([7]))
    s.finish(seq, "abort")
    hashes = chain(prompt)
    assert [s.allocator.allocate() for _ in range(2)] == [table[3], table[2]]
    assert s.allocator.lookup(hashes[2]) is None  # the tail went first
    assert s.allocator.lookup(hashes[0]) == table[0] and s.allocator.lookup(hashes[1]) == table[1]


def test_a_shared_block_is_freed_only_after_every_holder_releases_it():
    a = BlockAllocator(5, BLOCK, enable_prefix_caching=True)
    block = a.allocate()
    a.register(block, 1234)
    assert a.lookup(1234) == block and a.ref_counts[block] == 2  # a second sequence shares it
    a.release(block)
    assert block not in a.free and a.num_free == 3
    a.release(block)
    assert block in a.free and a.num_free == 4
    assert a.lookup(1234) == block  # freed but cached: still found by its hash


def test_zero_block_is_never_handed_out_and_running_out_raises():
    a = BlockAllocator(4, BLOCK, enable_prefix_caching=False)
    assert a.num_blocks == 3
    taken = sorted(a.allocate() for _ in range(3))
    assert taken == [1, 2, 3] and a.take_fresh() == [1, 2, 3] and a.usage == 1.0
    with pytest.raises(KeyError):  # callers check num_free first (Scheduler._grow)
        a.allocate()
    a.register(taken[0], 99)  # prefix caching off: nothing is recorded
    assert a.lookup(99) is None
    with pytest.raises(ValueError, match="kv-cache-memory"):
        BlockAllocator(1, BLOCK, enable_prefix_caching=True)


def test_scheduler_waits_instead_of_overdrawing_the_allocator():
    s = make_scheduler(num_blocks=2)
    big = make_seq(list(range(10, 30)))  # 5 blocks: more than the cache holds
    s.add(big)
    assert not s.schedule()
    assert s.waiting[0] is big and big.block_table == [] and s.allocator.num_free == 2


def test_zero_blocks_zeroes_exactly_the_new_blocks_in_every_layer():
    """A step's fresh blocks are zeroed in every layer's K and V (in runs of consecutive blocks, in
    any order, duplicates harmless); every other block keeps its bytes."""
    import torch

    from tokenmill.engine.worker.kv_cache import KVCache, consecutive_runs

    assert consecutive_runs([7, 3, 4, 5, 9, 4, 10]) == [(3, 6), (7, 8), (9, 11)]
    assert consecutive_runs([]) == []
    cache = KVCache(
        num_layers=3,
        num_blocks=12,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.data.fill_(1.0)
    fresh = [7, 3, 4, 5, 9, 4, 10]
    cache.zero_blocks(fresh)
    zeroed = torch.zeros(cache.data.shape[1], dtype=torch.bool)
    zeroed[sorted(set(fresh))] = True
    per_block = cache.data.transpose(0, 1).reshape(cache.data.shape[1], -1)
    assert (per_block[zeroed] == 0).all() and (per_block[~zeroed] == 1).all()
