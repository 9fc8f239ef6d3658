"""What the model runner hands back for one step: the one thing `Scheduler.update_from_output`
lands (vLLM's `ModelRunnerOutput`).

Sampled tokens are listed per sampling row, in the order of `SchedulerOutput.sampled`; what a
prefill chunk yields besides (its prompt positions' logprobs, its pooled hidden states) is keyed
by the sequence, so no reader needs to know the order of the rows it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.outputs import Logprob, PromptLogprob, RankedLogprob


@dataclass(frozen=True)
class PromptScores:
    """The logprobs one chunk's positions give the prompt token after each (scoring, echo), as the
    model thread computed them; `entries` shapes them for the sequence."""

    targets: list[int]  # per scored position: the prompt token it scores
    chosen: list[float]  # its logprob
    ranks: list[int]  # its rank (1 = the most likely token)
    top_ids: list[list[int]]  # per position: the top alternatives (at least num_top of them)
    top_logprobs: list[list[float]]
    num_top: int  # alternatives to report per position (the request's prompt_logprobs)

    def entries(self) -> list[PromptLogprob]:
        """Per position: the scored token first, then the top alternatives."""
        entries = []
        for i, target in enumerate(self.targets):
            entry = {target: RankedLogprob(self.chosen[i], self.ranks[i])}
            for rank, (token, logprob) in enumerate(
                zip(self.top_ids[i][: self.num_top], self.top_logprobs[i][: self.num_top])
            ):
                entry.setdefault(token, RankedLogprob(logprob, rank + 1))
            entries.append(entry)
        return entries


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results. A speculative step's sampled token follows the drafts accepted before it."""

    sampled_token_ids: list[int] = field(default_factory=list)  # per sampling row
    logprobs: list[Logprob | None] | None = None  # per sampling row, when any row asked for them
    accepted_token_ids: list[list[int]] | None = None  # speculative steps: per sampling row, the accepted drafts
    accepted_logprobs: list[list[Logprob | None]] | None = None
    prompt_logprobs: dict[int, PromptScores] = field(default_factory=dict)  # by seq id
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # by seq id: fp32 sum of the chunk's pooled rows
