"""Continuous batching: which sequences run in the next step, and how many tokens each; and the one
place where a step's results advance the sequences.

Every step has a token budget. Running sequences go first (one token each when decoding, the
next chunk when their prompt is still being prefilled), then waiting ones are admitted in arrival
order while budget, sequence slots and KV blocks last. When a running sequence needs a block and
none is free, the newest running sequence is preempted: its blocks are freed and it is recomputed
later (its generated tokens are kept and prefilled with the prompt). Under the priority policy
(vLLM's `--scheduling-policy priority`) waiting sequences are admitted by (priority, arrival), lower
first, and the running sequence preempted is the last by that order.

A scheduled step advances its sequences at once (`schedule`): their computed-token counts move
past the step's tokens and each sampling sequence gets a placeholder for its next token, so the
next step can be planned while this one runs. `update_from_output` is where the step's
`ModelRunnerOutput` lands: placeholders resolved, token stops checked (stop token ids, EOS, a
complete grammar, max_tokens, the context length), finished sequences freed; stop strings are
the output processor's, which reads the text. `take_back` undoes a step that failed.

Speculative decoding: a sequence about to decode one token may also run up to K draft tokens
after it (from the n-gram `draft_lookup` at scheduling, or filled in by the draft model right
after: `SchedulerOutput.with_drafts`), a small chunk with cached context that the budget and the
block allocation count in full. `update_from_output` lands the drafts the sampler accepted, then
its own token, one at a time through the token stops; the K/V of rejected drafts are forgotten
(the computed count stops before them, blocks past the sequence's end are freed, and only blocks
of accepted tokens are ever hashed into the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.engine.core.block_manager import BlockAllocator, block_hash
from tokenmill.engine.core.sequence import Sequence, SequenceStatus, placeholder
from tokenmill.engine.outputs import Logprob
from tokenmill.engine.runner_output import ModelRunnerOutput
from tokenmill.engine.structured_output.manager import StructuredOutputManager


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # This chunk reaches the end of the sequence's known tokens, so a token is sampled.
    samples: bool
    # The sequence as it was before this step advanced it: where the step's tokens start, and what
    # `take_back` restores when the step fails. `epoch` tells whether its blocks were freed since.
    epoch: int
    num_computed_before: int
    num_tokens_before: int
    # Positions [from, to) whose logits score the next prompt token (params.prompt_logprobs).
    prompt_logprobs_from: int = 0
    prompt_logprobs_to: int = 0
    # Speculative decoding: draft tokens run after the sequence's next token (counted in
    # num_new_tokens), and the tokens themselves once known (the draft model fills them after scheduling).
    num_spec_tokens: int = 0
    draft_tokens: tuple[int, ...] = ()

    @property
    def num_known_tokens(self) -> int:
        """The sequence's own tokens computed by the step (without the drafts)."""
        return self.num_new_tokens - self.num_spec_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        return range(self.prompt_logprobs_from, self.prompt_logprobs_to)

    @property
    def pooled_positions(self) -> range:
        """Positions of this chunk whose hidden states an embedding request pools."""
        pooling = self.seq.pooling
        end = self.num_computed_before + self.num_new_tokens
        if pooling is None:
            return range(0)
        if pooling.pooling == "mean":
            return range(self.num_computed_before, end)
        return range(end - 1, end) if end == len(self.seq.prompt_token_ids) else range(0)


@dataclass(frozen=True)
class SchedulerOutput:
    prefills: tuple[ScheduledSeq, ...]  # chunks of more than one token (prompts, recomputation)
    # Exactly one new token each, attended in one batched call; shortest block table first, so the
    # runner's length groups are contiguous runs.
    decodes: tuple[ScheduledSeq, ...]
    # Speculative decodes: one token and its drafts each, attended like chunks with cached context.
    speculative: tuple[ScheduledSeq, ...] = ()

    @property
    def all(self) -> tuple[ScheduledSeq, ...]:
        """Every scheduled sequence, in the order of the step's tokens."""
        return self.prefills + self.speculative + self.decodes

    @property
    def chunks(self) -> tuple[ScheduledSeq, ...]:
        """The sequences that run more than one token (prefill chunks, speculative decodes)."""
        return self.prefills + self.speculative

    def without_drafts(self) -> SchedulerOutput:
        """This step with its speculative decodes as plain decodes (their drafts could not be made)."""
        plain = (replace(item, num_new_tokens=item.num_known_tokens, num_spec_tokens=0) for item in self.speculative)
        return replace(
            self,
            speculative=(),
            decodes=tuple(sorted((*self.decodes, *plain), key=lambda item: len(item.seq.block_table))),
        )

    def with_drafts(self, drafts: Seq[tuple[int, ...]]) -> SchedulerOutput:
        """This step with the draft tokens of its speculative decodes filled in, in their order."""
        assert all(len(d) == item.num_spec_tokens for item, d in zip(self.speculative, drafts, strict=True))
        return replace(
            self, speculative=tuple(replace(item, draft_tokens=tuple(d)) for item, d in zip(self.speculative, drafts))
        )

    @property
    def sampled(self) -> tuple[ScheduledSeq, ...]:
        """The sequences that sample, in the order of the sampler's rows (placeholder row numbers)."""
        return tuple(item for item in self.all if item.samples)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.all)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes or self.speculative)


@dataclass
class SeqUpdate:
    """A live sequence of a landed step and the output tokens the step gave it (for the output
    processor, which adds their text)."""

    seq: Sequence
    first_output: int  # the output index of the step's first new token
    # The tokens whose text follows, in order (all the step landed but a token the grammar rejected).
    new_token_ids: list[int] = field(default_factory=list)
    stopped_on_token: bool = False  # ended by a stop token id or EOS: no stop string in its text changes that


@dataclass
class SpecDecodeStats:
    """Speculative decoding totals since the engine started."""

    num_drafts: int = 0  # verification steps of a sequence
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


# vLLM's --scheduling-policy values.
SCHEDULING_POLICIES = ("fcfs", "priority")

# Draft tokens for a sequence, at most the given number (n-gram lookup).
DraftLookup = Callable[[Sequence, int], tuple[int, ...]]


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        num_speculative_tokens: int = 0,
        draft_lookup: DraftLookup | None = None,
        max_loras: int | None = None,
        structured_outputs: StructuredOutputManager[Any] | None = None,
        policy: str = "fcfs",
    ) -> None:
        """`num_speculative_tokens`: most drafts per decoding sequence (0: no speculation); they come
        from `draft_lookup` when given, else a draft model fills them in after scheduling.
        `max_loras`: the most distinct LoRA adapters the running batch may hold (None: no LoRA).
        `structured_outputs`: what a constrained sequence's tokens land through. `policy`: "fcfs"
        (arrival order) or "priority" (each sequence's `priority_key`)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {policy!r}")
        self.by_priority = policy == "priority"
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Keep a few blocks free when admitting new sequences so running ones can keep decoding.
        self.watermark_blocks = max(1, allocator.num_blocks // 100)
        self._released: list[int] = []  # ids of sequences ended since the last step (see take_released)
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_lookup = draft_lookup
        self.spec_stats = SpecDecodeStats()
        self.max_loras = max_loras
        self.structured_outputs = structured_outputs

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        """`seq` in its place by priority_key (the waiting queue is kept in that order)."""
        key = seq.priority_key
        index = next((i for i, other in enumerate(self.waiting) if other.priority_key > key), len(self.waiting))
        self.waiting.insert(index, seq)

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
        seq.pooled_sum = None  # pooled rows are summed per epoch: a recomputation starts over
        seq.epoch += 1

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse cached full blocks of the sequence's known tokens (at admission, before any compute)."""
        if not self.allocator.enable_prefix_caching or seq.block_table:
            return
        # Leave at least one token to compute: its logits give the next token (its hidden state, an
        # embedding). A cached block has no logits or hidden states: mean pooling needs every
        # position's, scoring the prompt those of the positions not scored yet.
        limit = seq.num_tokens - 1
        if seq.pooling is not None and seq.pooling.pooling == "mean":
            limit = 0
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            limit = min(limit, len(seq.prompt_logprobs) - 1)
        max_blocks = limit // self.block_size
        parent = None
        extra = seq.prefix_cache_keys
        for i in range(max_blocks):
            h = block_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size], extra)
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
        extra = seq.prefix_cache_keys
        for i in range(len(seq.block_hashes), full):
            parent = block_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size], extra)
            seq.block_hashes.append(parent)
            self.allocator.register(seq.block_table[i], parent)

    # -- planning a step -----------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free(seq)
        if seq.prefill_only:
            seq.finishing = False  # its in-flight last chunk no longer ends it: the recomputation will
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drafts(self, seq: Sequence, budget: int) -> tuple[int, tuple[int, ...]]:
        """(how many draft tokens, the tokens when known now) to run after a decoding sequence's
        next token. Never more than could be accepted: each accepted draft is one more output token,
        within max_tokens and the context length."""
        if (
            not self.num_speculative_tokens
            or seq.constrained
            or seq.num_pending
            or seq.prefill_only
            or seq.num_tokens - seq.num_computed_tokens != 1
        ):
            return 0, ()  # (a structured output's grammar decides each token after the one before)
        limit = min(
            self.num_speculative_tokens,
            budget - 1,
            seq.params.max_tokens - seq.num_resolved_outputs - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if limit <= 0:
            return 0, ()
        if self.draft_lookup is None:
            return limit, ()
        drafts = self.draft_lookup(seq, limit)
        return len(drafts), drafts

    def schedule(self) -> SchedulerOutput:
        """Plan the next step and advance its sequences as if its tokens were already known."""
        budget = self.max_num_batched_tokens
        chunks: list[tuple[Sequence, int, int, tuple[int, ...]]] = []  # (seq, own tokens, drafts, draft tokens)
        scheduled: set[int] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.finishing:  # its last token is being sampled right now: nothing more to run
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            num_drafts, drafts = self._drafts(seq, budget)
            if num_drafts and not self._grow(seq, seq.num_computed_tokens + n + num_drafts):
                num_drafts, drafts = 0, ()  # no blocks to spare for drafts: a plain decode (or a preemption)
            while not self._grow(seq, seq.num_computed_tokens + n):
                victim = self._victim(i, scheduled)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks.append((seq, n, num_drafts, drafts))
                scheduled.add(seq.seq_id)
                budget -= n + num_drafts
                i += 1
                continue
            # `seq` itself was preempted; the list shifted, so the same index is the next sequence.

        adapters = {s.lora.id for s in self.running if s.lora is not None}
        skipped: list[Sequence] = []  # waiting for a LoRA slot: later arrivals may go first
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._lora_fits(seq, adapters):
                skipped.append(self.waiting.popleft())
                continue
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
            if seq.lora is not None:
                adapters.add(seq.lora.id)
            chunks.append((seq, n, 0, ()))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return self._advance(chunks)

    def _victim(self, index: int, scheduled: set[int]) -> Sequence:
        """Whom to preempt so that running[index] can grow: the newest running sequence (under the
        priority policy, the last by priority_key of those from `index` on, running[index] included),
        never one this step already runs (then running[index] itself)."""
        if self.by_priority:
            return max(self.running[index:], key=lambda s: s.priority_key)
        victim = self.running[-1]
        return self.running[index] if victim.seq_id in scheduled else victim

    def _lora_fits(self, seq: Sequence, running_adapters: set[int]) -> bool:
        """Whether `seq` may join a running batch that uses `running_adapters` (vLLM's rule: at most
        --max-loras distinct adapters run at once; the others wait)."""
        if seq.lora is None or self.max_loras is None or seq.lora.id in running_adapters:
            return True
        return len(running_adapters) < self.max_loras

    def _advance(self, chunks: list[tuple[Sequence, int, int, tuple[int, ...]]]) -> SchedulerOutput:
        """Fix the step's order and move its sequences past it (placeholders for the sampled tokens)."""
        items = [
            ScheduledSeq(
                seq,
                n + k,
                seq.num_computed_tokens + n == seq.num_tokens and not seq.prefill_only,
                seq.epoch,
                seq.num_computed_tokens,
                seq.num_tokens,
                *seq.prompt_logprob_range(seq.num_computed_tokens, n),
                k,
                drafts,
            )
            for seq, n, k, drafts in chunks
        ]
        prefills = tuple(item for item in items if item.num_new_tokens > 1 and not item.num_spec_tokens)
        speculative = tuple(item for item in items if item.num_spec_tokens)
        decodes = tuple(
            sorted((item for item in items if item.num_new_tokens == 1), key=lambda item: len(item.seq.block_table))
        )
        out = SchedulerOutput(prefills, decodes, speculative)
        for item in items:
            seq = item.seq
            seq.num_computed_tokens += item.num_known_tokens  # (accepted drafts are added when they land)
            if seq.prefill_only and seq.num_computed_tokens == seq.num_tokens:
                seq.finishing = True  # its last chunk is running: it ends when that lands
        for row, item in enumerate(out.sampled):
            seq = item.seq
            seq.append_pending(placeholder(row))
            if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finishing = True  # known to end with this token: nothing to schedule after it
        return out

    # -- a step's results ----------------------------------------------------------------------

    def update_from_output(self, step: SchedulerOutput, output: ModelRunnerOutput) -> list[SeqUpdate]:
        """Land a finished step: register the blocks it filled, land prompt logprobs and pooled
        states, append each sampled token (after the draft tokens accepted before it, per sampled
        row), check the token stops, end and free finished sequences (prefill-only ones after their
        last chunk). Returns the step's sequences that were still live, with their new tokens."""
        updates: dict[int, SeqUpdate] = {}
        for item in step.all:
            seq = item.seq
            if seq.is_finished:  # aborted, or stopped a step earlier than the scheduler knew
                continue
            self._land_prefill(item, output)
            if seq.epoch == item.epoch:  # (not preempted since: the blocks are the ones computed)
                computed = item.num_computed_before + item.num_known_tokens
                self.register_full_blocks(seq, computed)
                if seq.prefill_only and computed == seq.num_tokens:
                    if seq.pooling is not None:
                        seq.embedding = seq.pooled_embedding()
                    self.finish(seq, "length")  # max_tokens 0: nothing to generate
            updates[seq.seq_id] = SeqUpdate(seq, seq.num_resolved_outputs)
        logprobs = output.logprobs or [None] * len(output.sampled_token_ids)
        for row, (item, token, logprob) in enumerate(zip(step.sampled, output.sampled_token_ids, logprobs)):
            if item.seq.is_finished:
                continue
            update = updates[item.seq.seq_id]
            if item.num_spec_tokens:
                drafts = output.accepted_token_ids[row] if output.accepted_token_ids is not None else []
                draft_logprobs = (
                    output.accepted_logprobs[row] if output.accepted_logprobs is not None else [None] * len(drafts)
                )
                self._land_speculative(item, update, drafts, draft_logprobs, token, logprob)
            else:
                self._land_token(update, token, logprob)
        return list(updates.values())

    def _land_speculative(
        self,
        item: ScheduledSeq,
        update: SeqUpdate,
        drafts: Seq[int],
        draft_logprobs: Seq[Logprob | None],
        token: int,
        logprob: Logprob | None,
    ) -> None:
        """The accepted drafts, then the sampled token, each through the token stops (nothing is
        appended past a stop); then the verified drafts' K/V count as computed and the blocks past
        the sequence's end, which held only rejected drafts, are freed."""
        seq = item.seq
        self.spec_stats.add(item.num_spec_tokens, len(drafts))
        seq.metrics.spec_num_drafts += 1
        seq.metrics.spec_num_draft_tokens += item.num_spec_tokens
        seq.metrics.spec_num_accepted_tokens += len(drafts)
        for new_token, new_logprob in zip((*drafts, token), (*draft_logprobs, logprob)):
            self._land_token(update, new_token, new_logprob)
            if seq.is_finished:
                return
        assert seq.epoch == item.epoch, "a speculative step was overtaken by a later one"
        seq.num_computed_tokens += len(drafts)
        self.register_full_blocks(seq, seq.num_computed_tokens)
        keep = -(-seq.num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self.allocator.release(block)
        del seq.block_table[keep:]

    @staticmethod
    def _land_prefill(item: ScheduledSeq, output: ModelRunnerOutput) -> None:
        """Hand a live sequence its chunk's prompt scores and pooled rows."""
        seq = item.seq
        # Scores stay valid across a preemption since launch (the step ran on the blocks it had).
        scores = output.prompt_logprobs.get(seq.seq_id)
        if scores is not None:
            seq.add_prompt_logprobs(item.prompt_logprobs_from, scores.entries())
        # Pooled sums do not: a preempted sequence sums its recomputed chunks anew.
        pooled = output.pooled.get(seq.seq_id)
        if pooled is not None and seq.epoch == item.epoch:
            seq.add_pooled(pooled)

    def _land_token(self, update: SeqUpdate, token: int, logprob: Logprob | None) -> None:
        """Append a sampled token and end the sequence if the token stops it."""
        seq = update.seq
        seq.resolve(token, logprob)
        params = seq.params
        grammar = self.structured_outputs if seq.constrained else None
        if grammar is not None and not grammar.accept(seq, token):
            # The step's mask allowed only tokens the grammar accepts: this is a bug, not the request's.
            self.finish(seq, "error", error=f"structured output: the grammar rejected sampled token {token}")
            return
        update.new_token_ids.append(token)
        if token in params.stop_token_ids:
            self.finish(seq, "stop", token)
            update.stopped_on_token = True
        elif not params.ignore_eos and token in self.eos_token_ids:
            self.finish(seq, "stop")
            update.stopped_on_token = True
        elif grammar is not None and grammar.is_complete(seq):
            self.finish(seq, "stop")  # the grammar is complete (its stop token taken, even with ignore_eos)
        elif seq.num_resolved_outputs >= params.max_tokens or seq.num_resolved_tokens >= self.max_model_len:
            self.finish(seq, "length")

    def finish(
        self, seq: Sequence, reason: str, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        """End a sequence (stopped, aborted or failed) and free its blocks at once; a sequence that
        has ended already (a stop string in the text of the step that ended it) only changes why."""
        ended = seq.is_finished
        seq.finish(reason, stop_reason, error)
        if ended:
            return
        seq.drop_pending()  # tokens a later step is sampling for it are not wanted
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
        self._released.append(seq.seq_id)

    def take_released(self) -> list[int]:
        """Sequences ended since the last call: the sampler may forget their per-sequence state."""
        released, self._released = self._released, []
        return released

    def take_back(self, step: SchedulerOutput) -> None:
        """Undo a step that never produced its tokens (it failed, or ran after a failed one)."""
        for item in reversed(step.all):
            seq = item.seq
            if seq.is_finished:
                continue
            if seq.epoch == item.epoch:
                seq.num_computed_tokens = item.num_computed_before
            seq.drop_pending(seq.num_tokens - item.num_tokens_before)
            seq.finishing = False
