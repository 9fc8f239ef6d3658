"""Speculative decoding without a model: the n-gram lookup; the sampler's verification of draft
tokens (greedy rule, penalties seeing the drafts, logprobs, and the output distribution of
rejection sampling against the target distribution by a chi-square test); the scheduler's
budgeting, landing and rollback of drafts."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.outputs import RequestMetrics
from tokenmill.engine.runner_output import ModelRunnerOutput
from tokenmill.engine.sample.sampler import Sampler, SamplingInput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.spec_decode.ngram import ngram_lookup
from tokenmill.engine.structured_output.params import StructuredOutputsParams

pytestmark = pytest.mark.unit

VOCAB = 8


# -- n-gram lookup ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_suffix():
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]  # suffix (6, 7) occurred at 1: 8, 9, 1 followed it
    assert ngram_lookup(tokens, 2, 4, 3) == (8, 9, 1)
    assert ngram_lookup(tokens, 2, 4, 10) == (8, 9, 1, 2, 6, 7)  # up to the end, never past it
    assert ngram_lookup(tokens, 3, 4, 3) == ()  # (2, 6, 7) never occurred before


def test_ngram_prefers_the_longest_then_the_most_recent_match():
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    # (1, 2, 3) occurred at 0 (then 40); (2, 3) more recently at 5 (then 50): the longer match wins.
    assert ngram_lookup(tokens, 2, 3, 1) == (40,)
    assert ngram_lookup(tokens, 2, 2, 1) == (50,)  # among (2, 3)'s occurrences, the latest
    repeated = [7, 7, 7, 7]
    assert ngram_lookup(repeated, 1, 3, 2) == (7,)  # (7, 7, 7) at 0, one token follows
    # A run: the latest (7, 7) is followed by one 7 only; the latest followed by 3 tokens wins.
    assert ngram_lookup([5, 7, 7, 7, 7, 7, 7], 2, 2, 3) == (7, 7, 7)
    assert ngram_lookup([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 3) == (8, 1, 2)
    assert ngram_lookup([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 4) == (9, 1, 2, 8)  # only the earliest has 4 after it


def naive_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """The rule written plainly: longest n first; the latest occurrence followed by k tokens, else
    the earliest."""
    if k <= 0:
        return ()
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            follow = (full[-1] if full else starts[0]) + n
            return tuple(tokens[follow : follow + k])
    return ()


def test_ngram_lookup_equals_the_plain_rule_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(3) for _ in range(rng.randint(0, 14))]
        min_n = rng.randint(1, 3)
        args = (min_n, rng.randint(min_n, 4), rng.randint(0, 4))
        assert ngram_lookup(tokens, *args) == naive_lookup(tokens, *args), (tokens, args)


def test_ngram_proposer_follows_a_growing_sequence():
    """The proposer's cached arrays: equal to a fresh lookup as tokens are appended, and after
    tokens are dropped (a step taken back)."""
    import random

    from tokenmill.engine.spec_decode.ngram import NgramProposer

    rng, proposer = random.Random(1), NgramProposer(1, 3)
    seq = make_seq(0, SamplingParams())
    for _ in range(60):
        seq.token_ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.2:
            del seq.token_ids[-1:]
        assert proposer(seq, 3) == ngram_lookup(list(seq.token_ids), 1, 3, 3)


def test_ngram_edge_cases():
    assert ngram_lookup([], 1, 3, 4) == ()
    assert ngram_lookup([3], 1, 3, 4) == ()
    assert ngram_lookup([3, 3], 1, 3, 4) == (3,)
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 4) == ()  # nothing repeats
    assert ngram_lookup([1, 2, 1, 2], 1, 3, 0) == ()


# -- verification in the sampler ----------------------------------------------------------------


def make_seq(seq_id: int, params: SamplingParams, outputs: tuple[int, ...] = ()) -> Sequence:
    seq = Sequence(seq_id, f"req-{seq_id}", 0, (1, 2), params, RequestMetrics(arrival_time=0.0))
    seq.output_token_ids.extend(outputs)
    seq.token_ids.extend(outputs)
    return seq


def verify(logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]], seed: int = 0):
    batch = SamplingInput.of(seqs, [len(s.output_token_ids) for s in seqs], VOCAB, drafts)
    return Sampler(VOCAB, seed=seed, device=torch.device("cpu"))(logits, batch)


ROW = torch.tensor([0.0, 1.0, 2.0, 5.0, 4.0, 0.0, -1.0, 0.5])  # argmax 3, then 4


@pytest.mark.parametrize(
    "drafts, accepted, token",
    [
        ((3, 3), [3, 3], 3),  # all accepted: the bonus token follows
        ((3, 4), [3], 3),  # the second is not the argmax: the model's own token replaces it
        ((4, 3), [], 3),  # the first is rejected: nothing of the drafts
    ],
)
def test_greedy_accepts_the_argmax_prefix(drafts, accepted, token):
    out = verify(ROW.repeat(3, 1), [make_seq(0, SamplingParams(temperature=0))], [drafts])
    assert out.accepted == [accepted] and out.tokens == [token]


def test_rows_see_the_drafts_before_them_in_penalties():
    """Row j's penalties count drafts 0..j-1 as generated: a frequency penalty of 2 moves row 1's
    argmax from 3 (logit 5, drafted once before: 3) to 4, exactly as decoding one by one would."""
    seq = make_seq(0, SamplingParams(temperature=0, frequency_penalty=2.0))
    out = verify(ROW.repeat(3, 1), [seq], [(3, 3)])
    assert out.accepted == [[3]] and out.tokens == [4]


def test_mixed_rows_and_logprobs():
    """A plain row and a speculating row in one batch; logprobs of every emitted token are those of
    its own row's raw distribution."""
    plain = make_seq(0, SamplingParams(temperature=0, logprobs=2))
    spec = make_seq(1, SamplingParams(temperature=0, logprobs=1))
    logits = torch.stack([ROW.flip(0), ROW, ROW * 2, ROW * 3])  # plain row, then the 3 rows of `spec`
    out = verify(logits, [plain, spec], [(), (3, 3)])
    assert out.tokens == [4, 3] and out.accepted == [[], [3, 3]]
    logp = logits.log_softmax(-1)
    assert out.logprobs[0][0] == pytest.approx(logp[0, 4].item())
    assert [lp[0] for lp in out.accepted_logprobs[1]] == pytest.approx([logp[1, 3].item(), logp[2, 3].item()])
    assert out.logprobs[1][0] == pytest.approx(logp[3, 3].item())
    assert list(out.logprobs[1][1]) == [3]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` under `probs` (cells with probability 0 must be empty)."""
    n = counts.sum()
    assert (counts[probs == 0] == 0).all(), "a token outside the target distribution was drawn"
    kept = probs > 0
    expected = n * probs[kept]
    statistic = ((counts[kept] - expected) ** 2 / expected).sum()
    dof = int(kept.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic.double() / 2))


def test_rejection_sampling_keeps_the_target_distribution():
    """20,000 sequences, each verifying the same two drafts against three rows of logits with
    temperature and top-k: the first output token follows the target distribution of row 0, the
    second (when the first draft was accepted) that of row 1, the third that of row 2, whatever the
    drafts were. The drafts are a likely token, an unlikely one and one top-k removes."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    params = SamplingParams(temperature=0.7, top_k=5)
    kth = logits.topk(5, dim=-1).values[:, -1:]
    target = (logits / 0.7).masked_fill(logits < kth, float("-inf")).softmax(-1)
    order = logits.argsort(dim=-1, descending=True)
    drafts = (int(order[0, 0]), int(order[1, 6]))  # row 1's draft is outside its top 5: always rejected
    n = 20000
    out = verify(logits.repeat(n, 1), [make_seq(i, params) for i in range(n)], [drafts] * n, seed=1)
    emitted = [accepted + [token] for accepted, token in zip(out.accepted, out.tokens)]
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).double()
    assert _chi_square_p(first, target[0].double()) > 1e-3
    after_first = [e for e in emitted if len(e) > 1]
    assert len(after_first) == (first[drafts[0]]).item()  # the first draft is accepted exactly when emitted
    second = torch.bincount(torch.tensor([e[1] for e in after_first]), minlength=VOCAB).double()
    assert _chi_square_p(second, target[1].double()) > 1e-3
    assert second[drafts[1]] == 0 and not any(len(e) > 2 for e in emitted)


def test_rejection_sampling_third_row_and_seeded_reproducibility():
    """Drafts that are each row's argmax: accepted often enough to test the bonus row's
    distribution; seeded sequences draw the same tokens on a second run."""
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    drafts = (int(logits[0].argmax()), int(logits[1].argmax()))
    target = logits.softmax(-1)
    n = 20000
    out = verify(logits.repeat(n, 1), [make_seq(i, SamplingParams(temperature=1.0)) for i in range(n)], [drafts] * n)
    third = [token for accepted, token in zip(out.accepted, out.tokens) if len(accepted) == 2]
    counts = torch.bincount(torch.tensor(third), minlength=VOCAB).double()
    assert len(third) > 1000 and _chi_square_p(counts, target[2].double()) > 1e-3
    rejected_first = [token for accepted, token in zip(out.accepted, out.tokens) if not accepted]
    assert drafts[0] not in rejected_first  # a rejected draft is never drawn again in its place

    seeded = [make_seq(i, SamplingParams(temperature=1.0, seed=7)) for i in range(50)]
    runs = [verify(logits.repeat(50, 1), seeded, [drafts] * 50, seed=s) for s in (0, 1)]  # engine seeds differ
    assert runs[0].accepted == runs[1].accepted and runs[0].tokens == runs[1].tokens


# -- the scheduler: budget, blocks, landing and rollback ---------------------------------------


def spec_scheduler(
    drafts: tuple[int, ...], num_blocks: int = 64, budget: int = 64, k: int = 4, prefix_caching: bool = True
):
    """A scheduler whose n-gram lookup always proposes `drafts` (cut to the limit it is given)."""
    from tokenmill.engine.core.block_manager import BlockAllocator
    from tokenmill.engine.core.scheduler import Scheduler

    allocator = BlockAllocator(num_blocks + 1, 4, prefix_caching)
    return Scheduler(
        allocator,
        8,
        budget,
        1024,
        eos_token_ids=[0],
        num_speculative_tokens=k,
        draft_lookup=lambda seq, limit: drafts[:limit],
    )


def decoding_seq(scheduler, prompt_len: int = 6, **params) -> Sequence:
    """A sequence admitted, prefilled and given its first token (7) by one step."""
    seq = Sequence(
        99, "r", 0, tuple(range(10, 10 + prompt_len)), SamplingParams(**params), RequestMetrics(arrival_time=0.0)
    )
    scheduler.add(seq)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput([7]))
    return seq


def test_scheduler_budgets_drafts_and_rolls_back_rejected_ones():
    s = spec_scheduler((20, 21, 22, 23))
    seq = decoding_seq(s, prompt_len=6, max_tokens=50)  # 7 tokens: 2 blocks of 4
    out = s.schedule()
    (item,) = out.speculative
    assert (item.num_new_tokens, item.num_spec_tokens, item.draft_tokens) == (5, 4, (20, 21, 22, 23))
    assert not out.decodes and len(seq.block_table) == 3  # positions 6..10 need a third block
    assert seq.num_computed_tokens == 7  # the drafts count only once accepted
    # Two drafts accepted, then the model's own token: 3 new tokens, K/V valid through the 2nd draft.
    s.update_from_output(out, ModelRunnerOutput([30], accepted_token_ids=[[20, 21]]))
    assert seq.output_token_ids == [7, 20, 21, 30] and seq.num_computed_tokens == 9
    assert len(seq.block_table) == 3  # 10 tokens: still 3 blocks
    assert seq.metrics.spec_num_draft_tokens == 4 and seq.metrics.spec_num_accepted_tokens == 2
    assert s.spec_stats.accepted_per_position == [1, 1]
    # Registered in the prefix cache: only blocks whose tokens were all accepted and computed (2 full).
    assert len(seq.block_hashes) == 2


def test_scheduler_frees_blocks_of_rejected_drafts_and_respects_max_tokens():
    s = spec_scheduler((20, 21, 22, 23))
    seq = decoding_seq(s, prompt_len=4, max_tokens=4)  # 5 tokens; 3 more outputs allowed
    out = s.schedule()
    (item,) = out.speculative
    assert item.num_spec_tokens == 2  # at most max_tokens - outputs - 1 drafts: 2 accepted + 1 = 4 outputs
    assert len(seq.block_table) == 2
    free_before = s.allocator.num_free
    s.update_from_output(out, ModelRunnerOutput([30], accepted_token_ids=[[]]))  # all rejected
    assert seq.output_token_ids == [7, 30] and seq.num_computed_tokens == 5
    assert len(seq.block_table) == 2 and s.allocator.num_free == free_before  # 6 tokens still need 2 blocks
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([31], accepted_token_ids=[[20]]))
    assert seq.output_token_ids == [7, 30, 20, 31] and seq.finish_reason == "length"


def test_scheduler_stops_inside_accepted_drafts():
    s = spec_scheduler((20, 0, 22, 23))  # the second draft is EOS
    seq = decoding_seq(s, prompt_len=6)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([30], accepted_token_ids=[[20, 0, 22, 23]]))
    assert seq.output_token_ids == [7, 20, 0] and seq.finish_reason == "stop"  # nothing after EOS
    assert seq.block_table == [] and s.allocator.num_free == s.allocator.num_blocks


def test_scheduler_drafts_neither_grammar_nor_prefill():
    s = spec_scheduler((20, 21))
    grammar_seq = decoding_seq(s, prompt_len=6, structured_outputs=StructuredOutputsParams(regex="a+"))
    out = s.schedule()
    assert not out.speculative and [i.seq for i in out.decodes] == [grammar_seq]


def test_rows_without_drafts_draw_as_without_speculation():
    """A seeded sampled row that does not speculate, in a step where another row does: the same
    token as in a step without speculation (its RNG stream is not touched by the verification)."""
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, seed=11)
    plain = Sampler(VOCAB, seed=0, device=torch.device("cpu"))
    alone = [plain(logits[:1], SamplingInput.of([make_seq(0, params)], [0], VOCAB)).tokens[0] for _ in range(3)]
    mixed = Sampler(VOCAB, seed=0, device=torch.device("cpu"))
    seqs = [make_seq(0, params), make_seq(1, SamplingParams(temperature=1.0))]
    together = [mixed(logits, SamplingInput.of(seqs, [0, 0], VOCAB, [(), (1, 2)])).tokens[0] for _ in range(3)]
    assert together == alone


def test_rejection_sampling_per_row_settings_in_one_batch():
    """Interleaved sequences with different settings, drafts and draft counts in one batch: each
    follows its own target distribution (rows expanded per draft keep their sequence's settings)."""
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB) * 1.5
    cold = SamplingParams(temperature=0.5, top_k=3)
    hot = SamplingParams(temperature=1.5, top_p=0.8)
    kth = logits[0].topk(3).values[-1]
    cold_target = (logits[0] / 0.5).masked_fill(logits[0] < kth, float("-inf")).softmax(-1)
    hot_probs = (logits[0] / 1.5).softmax(-1)
    order = hot_probs.argsort(descending=True)
    kept = (hot_probs[order].cumsum(0) - hot_probs[order]) < 0.8
    hot_target = torch.zeros(VOCAB).scatter(0, order[kept], hot_probs[order][kept])
    hot_target /= hot_target.sum()
    n = 12000
    seqs, drafts, rows = [], [], []
    for i in range(n):
        cold_row = i % 2 == 0
        seqs.append(make_seq(i, cold if cold_row else hot))
        drafts.append((int(logits[0].argmax()),) if cold_row else (int(order[1]), 3))
        rows.extend([logits[0], logits[1]] if cold_row else [logits[0], logits[1], logits[1]])
    out = verify(torch.stack(rows), seqs, drafts, seed=5)
    first = [(accepted + [token])[0] for accepted, token in zip(out.accepted, out.tokens)]
    for parity, target in ((0, cold_target), (1, hot_target)):
        counts = torch.bincount(torch.tensor(first[parity::2]), minlength=VOCAB).double()
        assert _chi_square_p(counts, target.double()) > 1e-3, parity
