"""What a prefill yields besides the next token: the prompt tokens' logprobs (scoring, echo) and
pooled hidden states (embeddings).

The scheduler decides, per scheduled chunk, which prompt positions are scored and which are
pooled (`ScheduledSeq.prompt_logprob_positions` / `pooled_positions`); `PrefillWork.of` turns that
into rows of the step's hidden states on the scheduling thread; `PrefillWork.compute` runs on the
model thread right after the forward pass (only the rows asked for go through the LM head, in
slices so a long chunk never materialises a [tokens, vocab] matrix at once); the scheduler lands
the results by walking the same chunks in the same order (`PrefillResults.logprobs_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.outputs import RankedLogprob
from tokenmill.engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from tokenmill.engine.core.scheduler import ScheduledSeq

# Rows projected to the vocabulary at once: bounds the logits buffer (rows x vocab floats).
_LOGITS_SLICE_ROWS = 256

PromptLogprob = dict[int, RankedLogprob]  # the scored token first, then the top alternatives


@dataclass(frozen=True)
class PrefillWork:
    """The rows of one step's hidden states to score or pool (host tensors, built at launch)."""

    logprob_rows: torch.Tensor  # rows whose logits score the next prompt token
    logprob_targets: torch.Tensor  # the prompt token each of those rows scores
    num_top: int  # the most top alternatives any scored row reports
    pool_rows: torch.Tensor  # rows summed into pooled vectors
    pool_segments: torch.Tensor  # for each pooled row, the vector it is added to
    num_pooled: int

    @classmethod
    def of(cls, items: Seq[ScheduledSeq]) -> PrefillWork | None:
        """`items` in the order of the step's tokens (each chunk's rows are contiguous); None when
        no chunk scores or pools anything."""
        rows: list[int] = []
        targets: list[int] = []
        num_top = 0
        pool_rows: list[int] = []
        pool_segments: list[int] = []
        num_pooled = 0
        start = 0
        for item in items:
            first = item.num_computed_before  # the position of the chunk's first row
            scored = item.prompt_logprob_positions
            if scored:
                prompt = item.seq.prompt_token_ids
                rows.extend(start + p - first for p in scored)
                targets.extend(prompt[p + 1] for p in scored)
                num_top = max(num_top, item.seq.params.prompt_logprobs or 0)
            pooled = item.pooled_positions
            if pooled:
                pool_rows.extend(start + p - first for p in pooled)
                pool_segments.extend([num_pooled] * len(pooled))
                num_pooled += 1
            start += item.num_new_tokens
        if not rows and not num_pooled:
            return None
        return cls(_long(rows), _long(targets), num_top, _long(pool_rows), _long(pool_segments), num_pooled)

    def compute(
        self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int
    ) -> PrefillResults:
        """Model thread: score and pool the rows of `hidden` [tokens, dim] (the final norm's output)."""
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
        pooled = None
        if self.num_pooled:
            pooled = torch.zeros(self.num_pooled, hidden.shape[-1], dtype=torch.float32, device=device)
            pooled.index_add_(0, self.pool_segments.to(device), hidden[self.pool_rows.to(device)].float())
            pooled = pooled.cpu()

        def listed(parts: list[torch.Tensor]) -> list:
            return torch.cat(parts).tolist() if parts else []

        return PrefillResults(listed(chosen), listed(ranks), listed(top_ids), listed(top_vals), pooled)


def embedding(params: PoolingParams, pooled_sum: torch.Tensor, num_tokens: int) -> list[float]:
    """The embedding from the fp32 sum of a prompt's pooled rows (its last row alone for "last")."""
    vector = pooled_sum / num_tokens if params.pooling == "mean" else pooled_sum
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
    return vector.tolist()


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@dataclass(frozen=True)
class PrefillResults:
    """The model thread's answer to a `PrefillWork`, row for row."""

    chosen: list[float]  # per scored row: the logprob of the prompt token it scores
    ranks: list[int]
    top_ids: list[list[int]]  # per scored row: the top alternatives (num_top of them; empty when 0)
    top_logprobs: list[list[float]]
    pooled: torch.Tensor | None  # [num_pooled, dim] fp32 sums, on the CPU

    def logprobs_of(self, first_row: int, targets: Seq[int], num_top: int) -> list[PromptLogprob]:
        """The entries of the rows from `first_row` on, which score `targets`."""
        entries = []
        for i, target in enumerate(targets):
            row = first_row + i
            entry = {target: RankedLogprob(self.chosen[row], self.ranks[row])}
            if num_top:
                for rank, (token, logprob) in enumerate(
                    zip(self.top_ids[row][:num_top], self.top_logprobs[row][:num_top])
                ):
                    entry.setdefault(token, RankedLogprob(logprob, rank + 1))
            entries.append(entry)
        return entries
