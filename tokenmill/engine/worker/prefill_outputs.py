"""What a prefill yields besides the next token: the prompt tokens' logprobs (scoring, echo) and
pooled hidden states (embeddings).

The scheduler decides, per scheduled chunk, which prompt positions are scored and which are
pooled (`ScheduledSeq.prompt_logprob_positions` / `pooled_positions`); `PrefillWork.of` turns that
into rows of the step's hidden states while the runner prepares the step; `PrefillWork.compute`
runs on the model thread right after the forward pass (only the rows asked for go through the LM
head, in slices so a long chunk never materialises a [tokens, vocab] matrix at once) and hands
each sequence its own results, keyed by its id, in the step's `ModelRunnerOutput`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tokenmill.engine.core.scheduler import ScheduledSeq
from tokenmill.engine.runner_output import PromptScores

# Rows projected to the vocabulary at once: bounds the logits buffer (rows x vocab floats).
_LOGITS_SLICE_ROWS = 256


@dataclass(frozen=True)
class PrefillWork:
    """The rows of one step's hidden states to score or pool (host tensors, built at launch)."""

    logprob_rows: torch.Tensor  # rows whose logits score the next prompt token
    logprob_targets: torch.Tensor  # the prompt token each of those rows scores
    num_top: int  # the most top alternatives any scored row reports
    scored: tuple[tuple[int, int, int], ...]  # per scoring sequence, in row order: (seq id, rows, alternatives)
    pool_rows: torch.Tensor  # rows summed into pooled vectors
    pool_segments: torch.Tensor  # for each pooled row, the vector it is added to
    pooled_seq_ids: tuple[int, ...]  # the sequence of each pooled vector

    @classmethod
    def of(cls, items: Seq[ScheduledSeq]) -> PrefillWork | None:
        """`items` in the order of the step's tokens (each chunk's rows are contiguous); None when
        no chunk scores or pools anything."""
        rows: list[int] = []
        targets: list[int] = []
        scored: list[tuple[int, int, int]] = []
        pool_rows: list[int] = []
        pool_segments: list[int] = []
        pooled_seq_ids: list[int] = []
        start = 0
        for item in items:
            seq = item.seq
            first = item.num_computed_before  # the position of the chunk's first row
            positions = item.prompt_logprob_positions
            if positions:
                rows.extend(start + p - first for p in positions)
                targets.extend(seq.prompt_token_ids[p + 1] for p in positions)
                scored.append((seq.seq_id, len(positions), seq.params.prompt_logprobs or 0))
            pooled = item.pooled_positions
            if pooled:
                pool_rows.extend(start + p - first for p in pooled)
                pool_segments.extend([len(pooled_seq_ids)] * len(pooled))
                pooled_seq_ids.append(seq.seq_id)
            start += item.num_new_tokens
        if not scored and not pooled_seq_ids:
            return None
        return cls(
            _long(rows),
            _long(targets),
            max((num_top for _, _, num_top in scored), default=0),
            tuple(scored),
            _long(pool_rows),
            _long(pool_segments),
            tuple(pooled_seq_ids),
        )

    def compute(
        self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int
    ) -> tuple[dict[int, PromptScores], dict[int, torch.Tensor]]:
        """Model thread: score and pool the rows of `hidden` [tokens, dim] (the final norm's output);
        (prompt scores, pooled fp32 sums on the CPU), each by seq id."""
        device = hidden.device
        chosen, ranks, top_ids, top_vals = [], [], [], []
        rows, targets = self.logprob_rows.to(device), self.logprob_targets.to(device)
        for lo in range(0, len(rows), _LOGITS_SLICE_ROWS):
            target = targets[lo : lo + _LOGITS_SLICE_ROWS].unsqueeze(1)
            logp = compute_logits(hidden[rows[lo : lo + _LOGITS_SLICE_ROWS]])[:, :vocab_size].float().log_softmax(-1)
            target_logp = logp.gather(1, target)
            chosen.append(target_logp.squeeze(1))
            ranks.append((logp > target_logp).sum(dim=-1) + 1)  # 1 = the most likely token
            if self.num_top:
                vals, ids = logp.topk(self.num_top, dim=-1)
                top_vals.append(vals)
                top_ids.append(ids)
        pooled: dict[int, torch.Tensor] = {}
        if self.pooled_seq_ids:
            sums = torch.zeros(len(self.pooled_seq_ids), hidden.shape[-1], dtype=torch.float32, device=device)
            sums.index_add_(0, self.pool_segments.to(device), hidden[self.pool_rows.to(device)].float())
            pooled = dict(zip(self.pooled_seq_ids, sums.cpu()))
        return self._split(_listed(chosen), _listed(ranks), _listed(top_ids), _listed(top_vals)), pooled

    def _split(
        self, chosen: list[float], ranks: list[int], top_ids: list[list[int]], top_vals: list[list[float]]
    ) -> dict[int, PromptScores]:
        """The scored rows' results, each sequence's own (its rows are contiguous, in `scored` order)."""
        scores: dict[int, PromptScores] = {}
        targets = self.logprob_targets.tolist()
        lo = 0
        for seq_id, count, num_top in self.scored:
            hi = lo + count
            scores[seq_id] = PromptScores(
                targets[lo:hi],
                chosen[lo:hi],
                ranks[lo:hi],
                top_ids[lo:hi] if num_top else [[]] * count,
                top_vals[lo:hi] if num_top else [[]] * count,
                num_top,
            )
            lo = hi
        return scores


def _listed(parts: list[torch.Tensor]) -> list:
    return torch.cat(parts).tolist() if parts else []


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)
