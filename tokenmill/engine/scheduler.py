"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running sequences go first (one token each when decoding, the
next chunk when their prompt is still being prefilled), then waiting ones are admitted in arrival
order while budget, sequence slots and KV blocks last. When a running sequence needs a block and
none is free, the newest running sequence is preempted: its blocks are freed and it is recomputed
later (its generated tokens are kept and prefilled with the prompt).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache import BlockAllocator, block_hash
from tokenmill.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Whether this step reaches the end of the sequence's tokens, so a token is sampled (fixed when
    # scheduled: the engine advances the sequence as soon as the step is launched).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq]  # chunks of more than one token (prompts, recomputation)
    decodes: list[ScheduledSeq]  # exactly one new token, attended in one batched call

    @property
    def all(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.all)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Keep a few blocks free when admitting new sequences so running ones can keep decoding.
        self.watermark_blocks = max(1, allocator.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- block bookkeeping -------------------------------------------------------------------

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` enough blocks for `num_tokens` tokens; False if the allocator is short."""
        need = self._blocks_needed(seq, num_tokens)
        if need > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # tail blocks first, so prefixes stay cached longest
            self.allocator.release(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.epoch += 1

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse cached full blocks of the sequence's known tokens (at admission, before any compute)."""
        if not self.allocator.enable_prefix_caching or seq.block_table:
            return
        # Leave at least one token to compute: its logits give the next token.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent: int | None = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            block = self.allocator.lookup(h)
            if block is None:
                break
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        if not seq.prefix_queried:  # count each prompt once, not on every admission attempt
            seq.prefix_queried = True
            seq.num_cached_tokens = seq.num_computed_tokens
            self.allocator.stats.queries += seq.num_tokens
            self.allocator.stats.hits += seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence, num_computed: int) -> None:
        """After a step that computed the K/V of `seq`'s first `num_computed` tokens: hash the blocks
        that became full so later requests can share them."""
        if not self.allocator.enable_prefix_caching:
            return
        full = min(num_computed, seq.num_resolved_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = block_hash(parent, tokens)
            seq.block_hashes.append(parent)
            self.allocator.register(seq.block_table[i], parent)

    # -- the step ----------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        prefills: list[ScheduledSeq] = []
        decodes: list[ScheduledSeq] = []
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.finishing:  # its last token is being sampled right now: nothing more to run
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                if victim.seq_id in scheduled:  # never preempt what this step already runs
                    victim = seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                item = ScheduledSeq(seq, n)
                (decodes if n == 1 else prefills).append(item)
                scheduled.add(seq.seq_id)
                budget -= n
                i += 1
                continue
            # `seq` itself was preempted; the list shifted, so the same index is the next sequence.

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, seq.num_computed_tokens + n)
            if need > self.allocator.num_free - (self.watermark_blocks if self.running else 0):
                self.free(seq)  # give back prefix-cache references until it fits
                break
            self._grow(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.time()
            self.running.append(seq)
            (decodes if n == 1 else prefills).append(ScheduledSeq(seq, n))
            budget -= n
        return SchedulerOutput(prefills, decodes)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
