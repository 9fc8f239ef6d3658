"""Sampler maths on random logits, no model: each filter against transformers' logits processors,
penalties and logit_bias against hand-computed logits, greedy against argmax; every test runs on
both implementations of the final selection, tokenmill's CPU kernel and the torch ops.

A sampled row draws by inverse CDF: one float64 u ~ U[0, 1) from the row's RNG, then the first
token (in vocabulary order) whose running probability passes u. A seeded row's u is reproducible (a
generator seeded with seed + choice index), so the test computes the token the reference
distribution gives for the same u. Over many rows the tokens agree only if the sampler's filtered
distribution is the reference one (same kept set, same weights).
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tokenmill.engine.core.sequence import Sequence, placeholder
from tokenmill.engine.outputs import RequestMetrics
from tokenmill.engine.sample.sampler import Sampler, SamplingInput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.kernels.ops import cpu_kernels_available

pytestmark = pytest.mark.unit

VOCAB = 64
ROWS = 256
SEED0 = 1000


def make_seq(
    seq_id: int, params: SamplingParams, prompt: tuple[int, ...] = (1, 2, 3), outputs: tuple[int, ...] = ()
) -> Sequence:
    seq = Sequence(seq_id, f"req-{seq_id}", 0, prompt, params, RequestMetrics(arrival_time=0.0))
    for token in outputs:
        seq.output_token_ids.append(token)
        seq.token_ids.append(token)
    return seq


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def implementation(request, monkeypatch) -> str:
    """Every test twice: with the CPU kernel selecting tokens, and with the torch ops."""
    if request.param == "kernel" and not cpu_kernels_available(torch.device("cpu")):
        pytest.skip("tokenmill's CPU kernels are not built here")
    monkeypatch.setattr(sys.modules[__name__], "KERNEL", request.param == "kernel")
    return request.param


KERNEL = True  # (set by the fixture above)


def make_sampler(vocab: int = VOCAB, seed: int = 0) -> Sampler:
    sampler = Sampler(vocab, seed=seed, device=torch.device("cpu"), kernel=KERNEL)
    assert sampler.kernel == KERNEL
    return sampler


def sample(
    logits: torch.Tensor, seqs: list[Sequence], prev_tokens: list[int] | None = None, vocab: int = VOCAB
) -> list[int]:
    """Drive the sampler the way the engine does: a SamplingInput built from the sequences."""
    batch = SamplingInput.of(seqs, [len(s.output_token_ids) for s in seqs], vocab)
    return make_sampler(vocab)(logits, batch, prev_tokens).tokens


def draw(probs: torch.Tensor, seed: int) -> int:
    """The token a seeded row draws from `probs`: inverse CDF with the row's float64 uniform."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    u = torch.rand(1, dtype=torch.float64, generator=generator).item()
    cdf = probs.double().cumsum(-1)
    return int((cdf <= u * cdf[-1]).sum())


def seeded_rows(logits: torch.Tensor, vocab: int = VOCAB, **params) -> list[int]:
    return sample(
        logits, [make_seq(i, SamplingParams(seed=SEED0 + i, **params)) for i in range(len(logits))], vocab=vocab
    )


def reference_tokens(processed_logits: torch.Tensor) -> list[int]:
    probs = processed_logits.softmax(dim=-1)
    return [draw(probs[i], SEED0 + i) for i in range(len(probs))]


def hf_filter(logits: torch.Tensor, *warpers) -> torch.Tensor:
    input_ids = torch.zeros((len(logits), 1), dtype=torch.long)  # the warpers ignore it
    scores = logits.clone()
    for warper in warpers:
        scores = warper(input_ids, scores)
    return scores


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(7)) * 2.0


def assert_matches_hf(logits: torch.Tensor, expected_logits: torch.Tensor, **params) -> None:
    got = seeded_rows(logits, **params)
    expected = reference_tokens(expected_logits)
    kept = torch.isfinite(expected_logits)
    assert all(kept[i, t] for i, t in enumerate(got)), "sampled a token the reference filter removes"
    assert got == expected
    assert len(set(got)) > 5  # the test is not vacuous: the rows really sample


def test_temperature_matches_transformers(logits):
    for temperature in (0.3, 1.0, 2.5):
        assert_matches_hf(logits, hf_filter(logits, TemperatureLogitsWarper(temperature)), temperature=temperature)


def test_top_k_matches_transformers(logits):
    for k in (2, 5, 40):
        expected = hf_filter(logits, TopKLogitsWarper(k))
        assert int(torch.isfinite(expected[0]).sum()) == k
        assert_matches_hf(logits, expected, top_k=k)


def test_top_p_matches_transformers(logits):
    for p in (0.3, 0.8, 0.95):
        expected = hf_filter(logits, TopPLogitsWarper(p))
        assert torch.isinf(expected).any()  # the filter removes something on these logits
        assert_matches_hf(logits, expected, top_p=p)


def test_min_p_matches_transformers(logits):
    for p in (0.05, 0.2, 0.5):
        expected = hf_filter(logits, MinPLogitsWarper(p))
        assert torch.isinf(expected).any()
        assert_matches_hf(logits, expected, min_p=p)


def test_filters_combined_in_transformers_order(logits):
    expected = hf_filter(
        logits, TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9), MinPLogitsWarper(0.05)
    )
    assert_matches_hf(logits, expected, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)


def test_repetition_penalty_matches_transformers(logits):
    prompt, outputs = (4, 9, 17), (9, 30, 2)
    seqs = [make_seq(i, SamplingParams(seed=SEED0 + i, repetition_penalty=1.8), prompt, outputs) for i in range(ROWS)]
    input_ids = torch.tensor([prompt + outputs] * ROWS)
    expected = RepetitionPenaltyLogitsProcessor(1.8)(input_ids, logits.clone())
    # The penalty really moves both signs: positive logits shrink, negative ones grow more negative.
    seen = torch.tensor(sorted(set(prompt + outputs)))
    assert (logits[:, seen] > 0).any() and (logits[:, seen] < 0).any()
    assert sample(logits, seqs) == reference_tokens(expected)


def test_presence_and_frequency_penalties_follow_openai_definition():
    """OpenAI: logit[t] -= count[t] * frequency + (count[t] > 0) * presence, over generated tokens only."""
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(3))
    prompt, outputs = (7, 7, 8), (3, 3, 5)
    seqs = [
        make_seq(i, SamplingParams(seed=SEED0 + i, presence_penalty=0.5, frequency_penalty=0.25), prompt, outputs)
        for i in range(ROWS)
    ]
    expected = logits.clone()
    expected[:, 3] -= 2 * 0.25 + 0.5  # generated twice
    expected[:, 5] -= 1 * 0.25 + 0.5  # generated once; prompt tokens 7 and 8 are not penalised
    assert sample(logits, seqs) == reference_tokens(expected)


@pytest.mark.parametrize("presence,frequency", [(1.0, 0.0), (0.0, 1.0)])
def test_penalty_signs_under_greedy(presence, frequency):
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 2.0, 1.5  # 10 leads 11 by 0.5
    params = dict(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)
    assert sample(logits, [make_seq(0, SamplingParams(**params), outputs=())]) == [10]
    # A positive penalty on the leader (generated once) hands the lead to 11 ...
    assert sample(logits, [make_seq(0, SamplingParams(**params), outputs=(10,))]) == [11]
    # ... a negative one on the runner-up (generated once) lifts it over the leader.
    negative = dict(temperature=0.0, presence_penalty=-presence, frequency_penalty=-frequency)
    assert sample(logits, [make_seq(0, SamplingParams(**negative), outputs=(11,))]) == [11]


def test_penalty_history_resolves_the_previous_steps_placeholder():
    """The last output may still be a placeholder for the token the previous step is sampling."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 10], logits[:, 11] = 2.0, 1.5
    seqs = [
        make_seq(i, SamplingParams(temperature=0.0, presence_penalty=1.0), outputs=(placeholder(i),)) for i in range(2)
    ]
    # Row 0's previous token was 10 (penalised: 11 wins), row 1's was 40 (10 keeps the lead).
    assert sample(logits, seqs, prev_tokens=[10, 40]) == [11, 10]


def test_logit_bias_is_added_before_sampling(logits):
    bias = {5: 3.0, 9: -100.0, 12: 1.5, VOCAB + 3: 50.0}  # the last is outside the vocabulary: dropped
    expected = logits.clone()
    expected[:, 5] += 3.0
    expected[:, 9] -= 100.0
    expected[:, 12] += 1.5
    got = seeded_rows(logits, logit_bias=bias)
    assert got == reference_tokens(expected)
    assert 9 not in got and got.count(5) > got.count(4)


def test_greedy_is_argmax_and_mixes_with_sampled_rows(logits):
    seqs = [
        make_seq(i, SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(seed=SEED0 + i))
        for i in range(ROWS)
    ]
    got = sample(logits, seqs)
    argmax = logits.argmax(dim=-1).tolist()
    assert got[0::2] == argmax[0::2]
    assert got[1::2] == [draw(logits[i].softmax(-1), SEED0 + i) for i in range(1, ROWS, 2)]
    assert got[1::2] != argmax[1::2]
    # top_k=1 is greedy too, whatever the temperature.
    assert sample(logits[:4], [make_seq(i, SamplingParams(top_k=1, temperature=2.0)) for i in range(4)]) == argmax[:4]


def test_logprobs_are_of_the_raw_distribution(logits):
    seqs = [make_seq(0, SamplingParams(temperature=0.0, logprobs=3, logit_bias={7: 100.0}))]
    batch = SamplingInput.of(seqs, [0], VOCAB)
    out = make_sampler()(logits[:1], batch)
    assert out.tokens == [7]  # the bias picks the token ...
    chosen, top = out.logprobs[0]
    raw = logits[0].log_softmax(-1)
    assert chosen == pytest.approx(float(raw[7]), abs=1e-5)  # ... but its logprob is the model's
    assert list(top) == raw.topk(3).indices.tolist()


def test_greedy_takes_the_first_largest_and_nan_as_torch_argmax():
    """Ties go to the first index, a NaN wins (as torch.argmax), including in a vector's tail."""
    vocab = 37  # not a whole number of vectors
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4))
    logits[0, [3, 20]] = 9.0  # a tie
    logits[1, [33, 36]] = 9.0  # a tie in the tail
    logits[2, 30] = float("nan")
    logits[2, 5] = float("nan")
    logits[3] = float("-inf")
    logits[4, 36] = float("inf")
    seqs = [make_seq(i, SamplingParams(temperature=0.0)) for i in range(5)]
    assert sample(logits, seqs, vocab=vocab) == logits.argmax(dim=-1).tolist() == [3, 33, 5, 0, 36]


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities (cells with probability > 0)."""
    kept = probs > 0
    expected = probs[kept] * counts.sum()
    statistic = ((counts[kept] - expected) ** 2 / expected).sum()
    dof = int(kept.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic.double() / 2))


@pytest.mark.parametrize("filters", [dict(), dict(top_k=30, top_p=0.95, min_p=0.01)])
def test_unseeded_draws_follow_the_filtered_distribution(logits, filters):
    """20,000 unseeded rows of one distribution, a third of its tokens masked to -inf (as a grammar
    does), handed over column-major (as a compiled graph may): the histogram is the reference
    filters' softmax, and no token outside it is ever drawn."""
    row = logits[0].clone()
    row[::3] = float("-inf")
    warpers = [TemperatureLogitsWarper(0.8)]
    if filters:
        warpers += [TopKLogitsWarper(30), TopPLogitsWarper(0.95), MinPLogitsWarper(0.01)]
    expected = hf_filter(row[None], *warpers)[0].softmax(-1)
    n = 20000
    rows = row.repeat(n, 1).t().contiguous().t()
    assert rows.stride() == (1, n)
    seqs = [make_seq(i, SamplingParams(temperature=0.8, **filters)) for i in range(n)]
    counts = torch.bincount(torch.tensor(sample(rows, seqs)), minlength=VOCAB).double()
    assert counts[expected == 0].sum() == 0
    assert int((expected > 0).sum()) > 5 and _chi_square_p(counts, expected.double()) > 1e-3


@pytest.mark.parametrize("scale,top_p", [(0.3, 0.5), (0.3, 0.9), (4.0, 0.9)])
def test_top_p_over_a_large_vocabulary_matches_transformers(scale, top_p):
    """An odd-sized vocabulary whose nucleus is hundreds of tokens (flat logits) or a few (peaked),
    read from logits wider than the vocabulary (the columns past it must never be drawn)."""
    vocab, rows = 1003, 64
    logits = torch.randn(rows, vocab + 13, generator=torch.Generator().manual_seed(5)) * scale
    logits[:, vocab:] = 50.0  # padding columns of the model's output
    expected = hf_filter(logits[:, :vocab], TopPLogitsWarper(top_p))
    kept = int(torch.isfinite(expected[0]).sum())
    assert (kept > 256) if scale < 1 else (kept < 64)  # the nucleus really is large (or small)
    got = seeded_rows(logits, vocab=vocab, top_p=top_p)
    assert got == reference_tokens(expected) and max(got) < vocab
