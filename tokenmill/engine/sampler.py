"""Token selection for a whole batch at once: penalties, temperature, top-k/top-p/min-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.sequence import Sequence, placeholder_row

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """The rows one step samples, fixed when the step is launched."""

    seqs: list[Sequence]
    # Per row: how many output tokens precede the one being sampled (the penalties' history). The
    # last of them may still be a placeholder for the previous step's token.
    num_outputs: list[int]


def _resolved(tokens: list[int], prev_tokens: list[int] | None) -> list[int]:
    """`tokens` (a copy) with a trailing placeholder replaced by the previous step's token."""
    if tokens and tokens[-1] < 0:
        if prev_tokens is None:
            raise RuntimeError("a placeholder token without the previous step's tokens")
        tokens[-1] = prev_tokens[placeholder_row(tokens[-1])]
    return tokens


@dataclass
class SamplerOutput:
    tokens: list[int]
    # Per row: (logprob of the chosen token, {token: logprob} of the top-k), only when asked for.
    logprobs: list[tuple[float, dict[int, float]] | None]
    token_tensor: torch.Tensor | None = None  # `tokens` on the device (the next step's placeholders read it)


class Sampler:
    def __init__(self, vocab_size: int, seed: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, prev_tokens: list[int] | None = None) -> SamplerOutput:
        """logits: [len(batch.seqs), V] float32 of the last position of each sequence; `prev_tokens`:
        the previous step's sampled tokens, for placeholders still in the penalties' history."""
        seqs = batch.seqs
        logits = logits[:, : self.vocab_size]
        raw = logits
        params = [s.params for s in seqs]
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits.clone(), seqs)
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            history = [_resolved(s.output_token_ids[:n], prev_tokens) for s, n in zip(seqs, batch.num_outputs)]
            logits = self._apply_penalties(logits if logits is not raw else logits.clone(), seqs, history)

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == len(seqs):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, seqs)
            if greedy_rows:
                rows = torch.tensor(greedy_rows, device=logits.device)
                tokens[rows] = logits[rows].argmax(dim=-1)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, seqs, tokens), tokens)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        dev = logits.device
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 for p in params):
            k = torch.tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in params], device=dev)
            k = k.clamp(max=logits.shape[1])
            kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, _NEG_INF)
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            probs = self._top_p(probs, torch.tensor([p.top_p for p in params], device=dev))
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        # Exponential-race sampling (argmax p/q, q ~ Exp(1)) lets each seeded row use its own RNG.
        q = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            q[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=dev).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                q[i].exponential_(generator=s.generator)
        return (probs / q).argmax(dim=-1)

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

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for i, s in enumerate(seqs):
            for token, bias in s.params.logit_bias.items():
                if 0 <= token < logits.shape[1]:
                    logits[i, token] += bias
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence], history: list[list[int]]) -> torch.Tensor:
        dev = logits.device
        rows = len(seqs)
        vocab = logits.shape[1]
        # Output-token counts per row (presence/frequency) and a seen mask over prompt+output (repetition).
        counts = torch.zeros((rows, vocab), device=dev)
        seen = torch.zeros((rows, vocab), dtype=torch.bool, device=dev)
        for i, (s, outputs) in enumerate(zip(seqs, history)):
            if outputs:
                out = torch.tensor(outputs, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
            if s.params.repetition_penalty != 1.0:
                seen[i, torch.tensor(s.prompt_token_ids + outputs, device=dev)] = True
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=dev).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        presence = torch.tensor([s.params.presence_penalty for s in seqs], device=dev).unsqueeze(1)
        frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=dev).unsqueeze(1)
        return logits - frequency * counts - presence * (counts > 0).float()

    @staticmethod
    def _logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor):
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        result: list[tuple[float, dict[int, float]] | None] = [None] * len(seqs)
        if not wanted:
            return result
        rows = torch.tensor(wanted, device=raw.device)
        logp = raw[rows].log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
        k = max(seqs[i].params.logprobs or 0 for i in wanted)
        top_vals, top_ids = logp.topk(max(k, 1), dim=-1)
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs or 0
            result[i] = (chosen[j], dict(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())))
        return result
