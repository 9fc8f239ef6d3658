"""Token selection for a whole batch at once: grammar masks, penalties, temperature,
top-k/top-p/min-p, seeds.

The scheduling thread describes a step's sampling rows once, as an immutable `SamplingInput`
(`SamplingInput.of`); the sampler, on the model thread, reads only that. Per-row options are
independent, so a new per-row transform (a logits processor) is one more optional column here and
one more stage in `Sampler.__call__`, applied before the temperature like logit_bias.

Structured outputs: the allowed-token bitmask of the constrained rows (`GrammarMask`, filled by
the scheduling thread once those rows' earlier tokens are known) is applied first, so greedy,
temperature, top-k/top-p/min-p, logit_bias and penalties all act on allowed tokens only. Returned
logprobs are those of the model's raw distribution, as in vLLM: the grammar changes which token
is picked, not what the model thought of it.

Draws: each sampled row takes one float64 U[0, 1) from its RNG (its own, seeded with seed + choice
index, for a seeded request; else the engine's) and draws by inverse CDF over its filtered weights
in vocabulary order. On CPU the temperature, top-k/top-p/min-p, the draw and greedy rows' argmax
run as one kernel per row (tokenmill/kernels/csrc/cpu/sampling.cpp); elsewhere, and for speculative
steps, as torch ops. Both keep the same rows and draw the same way, so a seeded row gets the same
token from either, whatever else is in the batch.

Speculative decoding: a row whose sequence runs draft tokens becomes one row per position (its
next token, then one after each draft), each with the history up to it, so every transform above
acts exactly as it would have if the drafts had been generated one by one. The rows are then
verified with the standard rejection-sampling rule for a deterministic proposal: a greedy row
accepts its draft if it is the argmax; a sampled row accepts it with probability p(draft), and on
rejection samples from p without the draft (renormalised), which leaves each output token
distributed exactly as p. The first rejected row's token, or the last row's when every draft is
accepted, follows the accepted drafts.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tokenmill.engine.core.sequence import Sequence, placeholder_row
from tokenmill.engine.outputs import Logprob
from tokenmill.engine.structured_output.grammar import GrammarMask, apply_mask
from tokenmill.kernels import ops
from tokenmill.kernels.ops import cpu_kernels_available

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Penalties:
    """Repetition/presence/frequency penalties of the rows of a step (present when any row has one)."""

    # Per row: the output tokens before the one being sampled. The last may still be a placeholder
    # for the previous step's token (resolved by the sampler with that step's tokens).
    histories: tuple[tuple[int, ...], ...]
    prompts: tuple[tuple[int, ...] | None, ...]  # per row: the prompt, for rows with a repetition penalty
    repetition: tuple[float, ...]
    presence: tuple[float, ...]
    frequency: tuple[float, ...]


@dataclass(frozen=True)
class SamplingInput:
    """What the sampler needs about the rows of one step, fixed when the step is launched."""

    seq_ids: tuple[int, ...]  # keys of the per-sequence RNGs
    greedy: tuple[bool, ...]
    temperature: tuple[float, ...]  # 1.0 on greedy rows
    top_k: tuple[int, ...]  # 0 = off
    top_p: tuple[float, ...]  # 1.0 = off
    min_p: tuple[float, ...]  # 0.0 = off
    seeds: tuple[int | None, ...]  # per-row RNG seed; None = the engine's shared RNG
    logit_bias: tuple[tuple[int, int, float], ...]  # (row, token, bias)
    penalties: Penalties | None
    num_logprobs: tuple[int | None, ...]  # top alternatives to report; None = no logprobs
    grammar: GrammarMask | None = None  # allowed tokens of the rows with structured outputs
    # Speculative steps only: per row the draft token it verifies (-1: none, the sequence's last
    # row), and per sampled sequence its (first row, number of rows).
    draft_tokens: tuple[int, ...] | None = None
    spans: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def of(
        cls, seqs: Seq[Sequence], num_outputs: Seq[int], vocab_size: int, drafts: Seq[tuple[int, ...]] | None = None
    ) -> SamplingInput:
        """The rows `seqs`, each sampling its output token number `num_outputs[i]` (and, with
        `drafts`, one more row after each of its draft tokens `drafts[i]`)."""
        spans: list[tuple[int, int]] | None = None
        draft_tokens: list[int] | None = None
        params = [s.params for s in seqs]
        penalised = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        # Per row: the output tokens before the one it samples (read only for penalties).
        histories = [tuple(s.output_token_ids[:n]) if penalised else () for s, n in zip(seqs, num_outputs)]
        items = list(range(len(seqs)))  # the sampled sequence of each row
        if drafts is not None and any(drafts):
            spans, draft_tokens, items = [], [], []
            rows: list[Sequence] = []
            row_histories: list[tuple[int, ...]] = []
            for item, (seq, history, seq_drafts) in enumerate(zip(seqs, histories, drafts, strict=True)):
                spans.append((len(rows), len(seq_drafts) + 1))
                for i in range(len(seq_drafts) + 1):
                    rows.append(seq)
                    items.append(item)
                    row_histories.append(history + seq_drafts[:i] if penalised else ())
                    draft_tokens.append(seq_drafts[i] if i < len(seq_drafts) else -1)
            seqs, histories = rows, row_histories
            params = [s.params for s in seqs]
        penalties = None
        if penalised:
            penalties = Penalties(
                histories=tuple(histories),
                prompts=tuple(tuple(s.prompt_token_ids) if s.params.repetition_penalty != 1.0 else None for s in seqs),
                repetition=tuple(p.repetition_penalty for p in params),
                presence=tuple(p.presence_penalty for p in params),
                frequency=tuple(p.frequency_penalty for p in params),
            )
        return cls(
            seq_ids=tuple(s.seq_id for s in seqs),
            greedy=tuple(p.greedy for p in params),
            temperature=tuple(1.0 if p.greedy else p.temperature for p in params),
            top_k=tuple(max(p.top_k, 0) for p in params),
            top_p=tuple(p.top_p for p in params),
            min_p=tuple(p.min_p for p in params),
            # Choice i of a seeded request draws from seed + i, so the n choices differ.
            seeds=tuple(None if p.seed is None else (p.seed + s.index) % (1 << 64) for s, p in zip(seqs, params)),
            logit_bias=tuple(
                (row, token, bias)
                for row, p in enumerate(params)
                for token, bias in p.logit_bias.items()
                if 0 <= token < vocab_size
            ),
            penalties=penalties,
            num_logprobs=tuple(p.logprobs for p in params),
            grammar=_grammar_mask(seqs, items, vocab_size),
            draft_tokens=None if draft_tokens is None else tuple(draft_tokens),
            spans=None if spans is None else tuple(spans),
        )

    def __len__(self) -> int:
        return len(self.seq_ids)


def _grammar_mask(seqs: Seq[Sequence], items: Seq[int], vocab_size: int) -> GrammarMask | None:
    rows = tuple(i for i, s in enumerate(seqs) if s.constrained)
    return GrammarMask(rows, len(seqs), vocab_size, tuple(items[i] for i in rows)) if rows else None


@dataclass
class SamplerOutput:
    tokens: list[int]  # per sampled sequence (after its accepted drafts, in a speculative step)
    logprobs: list[Logprob | None]  # per sampled sequence, only when asked for
    token_tensor: torch.Tensor | None = None  # `tokens` on the device (the next step's placeholders read it)
    # Speculative steps: per sampled sequence, the draft tokens accepted before `tokens[i]` and their logprobs.
    accepted: list[list[int]] | None = None
    accepted_logprobs: list[list[Logprob | None]] | None = None


def _resolved(tokens: tuple[int, ...], prev_tokens: list[int] | None) -> list[int]:
    """`tokens` with a trailing placeholder replaced by the previous step's token."""
    out = list(tokens)
    if out and out[-1] < 0:
        if prev_tokens is None:
            raise RuntimeError("a placeholder token without the previous step's tokens")
        out[-1] = prev_tokens[placeholder_row(out[-1])]
    return out


class Sampler:
    """Lives on the model thread; holds the RNGs (the engine's, and one per seeded sequence)."""

    def __init__(self, vocab_size: int, seed: int, device: torch.device, kernel: bool = True) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # On CPU the final selection (temperature, filters, draw, argmax; after grammar masks, bias and
        # penalties) is tokenmill's kernel when it is built; `kernel=False` keeps the torch ops.
        self.kernel = kernel and cpu_kernels_available(device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}  # seq id -> its RNG

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the RNGs of sequences that ended."""
        for seq_id in seq_ids:
            self._seeded.pop(seq_id, None)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingInput, prev_tokens: list[int] | None = None
    ) -> SamplerOutput:
        """logits: [len(batch), V] float32 of the last position of each row; `prev_tokens`: the
        previous step's sampled tokens, for placeholders still in the penalties' history."""
        logits = logits[:, : self.vocab_size]
        raw = logits
        if batch.grammar is not None:
            if any(n is not None for n in batch.num_logprobs):
                logits = logits.clone()  # logprobs are of the raw distribution
            apply_mask(logits, batch.grammar, self.vocab_size)
        if batch.logit_bias:
            bias_rows, bias_tokens, biases = zip(*batch.logit_bias)
            logits = logits.index_put(
                (torch.tensor(bias_rows, device=logits.device), torch.tensor(bias_tokens, device=logits.device)),
                torch.tensor(biases, device=logits.device, dtype=logits.dtype),
                accumulate=True,
            )
        if batch.penalties is not None:
            logits = self._apply_penalties(logits, batch.penalties, prev_tokens)
        if batch.spans is not None:
            return self._verify(raw, logits, batch)

        tokens = self._select(logits, batch)
        return SamplerOutput(tokens.tolist(), self._logprobs(raw, batch.num_logprobs, tokens), tokens)

    def _select(self, logits: torch.Tensor, batch: SamplingInput) -> torch.Tensor:
        """A token per row: the argmax on greedy rows, a draw from the filtered distribution on the others."""
        if self.kernel:
            logits = logits.float()
            if logits.stride(-1) != 1:  # (a compiled graph can return them column-major)
                logits = logits.contiguous()
            return ops.sample_tokens(
                logits,
                list(batch.greedy),
                list(batch.temperature),
                list(batch.top_k),
                list(batch.top_p),
                list(batch.min_p),
                self._uniforms(batch),
            )
        if all(batch.greedy):
            return logits.argmax(dim=-1)
        tokens = self._draw(self._probs(logits, batch), self._uniforms(batch))
        greedy_rows = [i for i, g in enumerate(batch.greedy) if g]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = logits[rows].argmax(dim=-1)
        return tokens

    def _verify(self, raw: torch.Tensor, logits: torch.Tensor, batch: SamplingInput) -> SamplerOutput:
        """Rejection sampling of a speculative step's rows (see the module docstring)."""
        assert batch.spans is not None and batch.draft_tokens is not None  # (a speculative step's rows)
        dev = logits.device
        drafts = torch.tensor(batch.draft_tokens, device=dev)
        has_draft = drafts >= 0
        drafts_or_0 = drafts.clamp(min=0).unsqueeze(1)
        tokens = logits.argmax(dim=-1)
        accept = has_draft & (tokens == drafts)
        if not all(batch.greedy):
            probs = self._probs(logits, batch)
            probs = probs / probs.sum(dim=-1, keepdim=True)  # (top-p and min-p leave the kept mass unnormalised)
            accept_sampled = has_draft & (self._uniform(batch, dev) < probs.gather(1, drafts_or_0).squeeze(1))
            # A rejected draft's row samples from p without the draft (the draw needs no renormalising).
            residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, drafts_or_0, 0.0), probs)
            greedy = torch.tensor(batch.greedy, device=dev)
            tokens = torch.where(greedy, tokens, self._draw(residual, self._uniforms(batch)))
            accept = torch.where(greedy, accept, accept_sampled)
        chosen = torch.where(accept, drafts, tokens)  # each row's output token, if the sequence gets that far
        row_logprobs = self._logprobs(raw, batch.num_logprobs, chosen)
        accepted_rows = accept.tolist()
        last_rows, accepted, accepted_logprobs = [], [], []
        for first, count in batch.spans:
            num_accepted = 0
            while num_accepted < count - 1 and accepted_rows[first + num_accepted]:
                num_accepted += 1
            last_rows.append(first + num_accepted)
            accepted.append(list(batch.draft_tokens[first : first + num_accepted]))
            accepted_logprobs.append(row_logprobs[first : first + num_accepted])
        final = chosen[torch.tensor(last_rows, device=dev)]
        return SamplerOutput(final.tolist(), [row_logprobs[r] for r in last_rows], final, accepted, accepted_logprobs)

    def _uniform(self, batch: SamplingInput, device: torch.device) -> torch.Tensor:
        """A U[0, 1) draw for each sampled row with a draft (from the row's own RNG when it is
        seeded; rows without a draft draw nothing, so their RNG streams are as without speculation);
        1 elsewhere."""
        assert batch.draft_tokens is not None  # (a speculative step's rows)
        rows = [i for i, (d, g) in enumerate(zip(batch.draft_tokens, batch.greedy)) if d >= 0 and not g]
        draws = self._row_uniforms(batch, rows, torch.float32)
        return torch.tensor([draws.get(i, 1.0) for i in range(len(batch))], device=device)

    def _probs(self, logits: torch.Tensor, batch: SamplingInput) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k, top-p, min-p."""
        dev = logits.device
        logits = logits / torch.tensor(batch.temperature, device=dev).unsqueeze(1)
        if any(batch.top_k):
            k = torch.tensor([k or self.vocab_size for k in batch.top_k], device=dev).clamp(max=logits.shape[1])
            kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, _NEG_INF)
        probs = logits.softmax(dim=-1)
        if any(p < 1.0 for p in batch.top_p):
            probs = self._top_p(probs, torch.tensor(batch.top_p, device=dev))
        if any(batch.min_p):
            min_p = torch.tensor(batch.min_p, device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _uniforms(self, batch: SamplingInput) -> list[float]:
        """One float64 U[0, 1) per sampled row (see _row_uniforms); 0 on greedy rows, which draw nothing."""
        draws = self._row_uniforms(batch, [i for i, greedy in enumerate(batch.greedy) if not greedy], torch.float64)
        return [draws.get(i, 0.0) for i in range(len(batch))]

    def _row_uniforms(self, batch: SamplingInput, rows: list[int], dtype: torch.dtype) -> dict[int, float]:
        """One U[0, 1) of `dtype` for each of `rows`: from the row's own RNG when it is seeded, else
        from the engine's (one draw for all of those, in row order)."""
        draws: dict[int, float] = {}
        unseeded = [i for i in rows if batch.seeds[i] is None]
        if unseeded:
            values = torch.rand(len(unseeded), dtype=dtype, device=self.device, generator=self.generator)
            draws.update(zip(unseeded, values.tolist()))
        for i in rows:
            seed = batch.seeds[i]
            if seed is not None:
                generator = self._generator(batch.seq_ids[i], seed)
                draws[i] = torch.rand(1, dtype=dtype, device=self.device, generator=generator).item()
        return draws

    @staticmethod
    def _draw(weights: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
        """A token per row drawn from `weights` (unnormalised) by inverse CDF: the first token, in
        vocabulary order, whose running sum passes u * total (the CPU kernel draws the same way)."""
        cdf = weights.double().cumsum(dim=-1)
        target = torch.tensor(uniforms, dtype=torch.float64, device=weights.device).unsqueeze(1) * cdf[:, -1:]
        first = torch.searchsorted(cdf, target, right=True).squeeze(1)
        # (rounding can leave target at the total: the last token with weight then)
        last = weights.shape[1] - 1 - (weights.flip(-1) > 0).int().argmax(dim=-1)
        return torch.minimum(first, last)

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        generator = self._seeded.get(seq_id)
        if generator is None:
            generator = self._seeded[seq_id] = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        return generator

    @staticmethod
    def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p. The top token always survives, even when
        # top_p underflows the dtype to 0 (1e-300 in float32) and the comparison drops everything.
        drop = (cumulative - sorted_probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, pen: Penalties, prev_tokens: list[int] | None) -> torch.Tensor:
        dev = logits.device
        rows, vocab = logits.shape
        # Output-token counts per row (presence/frequency) and a seen mask over prompt+output (repetition).
        counts = torch.zeros((rows, vocab), device=dev)
        seen = torch.zeros((rows, vocab), dtype=torch.bool, device=dev)
        for i, (history, prompt) in enumerate(zip(pen.histories, pen.prompts)):
            outputs = _resolved(history, prev_tokens)
            if outputs:
                out = torch.tensor(outputs, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
            if prompt is not None:
                seen[i, torch.tensor(prompt + tuple(outputs), device=dev)] = True
        rep = torch.tensor(pen.repetition, device=dev).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        presence = torch.tensor(pen.presence, device=dev).unsqueeze(1)
        frequency = torch.tensor(pen.frequency, device=dev).unsqueeze(1)
        return logits - frequency * counts - presence * (counts > 0).float()

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, num_logprobs: tuple[int | None, ...], tokens: torch.Tensor
    ) -> list[Logprob | None]:
        wanted = [i for i, n in enumerate(num_logprobs) if n is not None]
        result: list[Logprob | None] = [None] * len(num_logprobs)
        if not wanted:
            return result
        rows = torch.tensor(wanted, device=raw.device)
        logp = raw[rows].log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        k = max(num_logprobs[i] or 0 for i in wanted)
        top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(wanted):
            n = num_logprobs[i] or 0
            result[i] = (chosen[j], dict(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())))
        return result
