"""How much grammar work one request may cost the engine per step.

Matching is done on the scheduling thread: advancing each sequence's matcher by its sampled token
and filling its row of the next step's bitmask. For most grammars that is cheap, but an ambiguous
grammar's matcher state can grow with every token (`root ::= b* "y"`, `b ::= "x"* "x"* "x"*`: each
token costs more than the last), and a 1,000-branch `anyOf` is costly per row, times sixteen rows
with `n=16`: every other stream's inter-token gap would grow by as much. So each request's matcher
time (all its sequences together) is metered with a token bucket: it earns MATCH_TIME_PER_STEP_S per
step it takes part in, may hold at most MATCH_TIME_BURST_S of credit, and is stopped (the engine
fails it with `GrammarTooExpensive`) once its credit runs out: from then on its matchers do no more
work (its rows are left unconstrained for the step that is still running; the request ends with an
error anyway), so one step overshoots the budget by one row's work at most. Time is the thread's CPU
time, so a busy machine preempting the engine thread mid-call costs no request its budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from tokenmill.errors import InvalidRequest

MATCH_TIME_PER_STEP_S = 0.01
MATCH_TIME_BURST_S = 0.2


class GrammarTooExpensive(InvalidRequest):
    """The request's grammar needs more matching work per step than the engine gives a request."""

    code = "grammar_too_expensive"


class MatchBudget:
    """One request's token bucket of matcher time."""

    def __init__(self) -> None:
        self.credit = MATCH_TIME_BURST_S
        self.exhausted = False

    def earn(self) -> None:
        """One more step's allowance."""
        self.credit = min(MATCH_TIME_BURST_S, self.credit + MATCH_TIME_PER_STEP_S)

    def spend(self, seconds: float) -> None:
        self.credit -= seconds
        if self.credit < 0:
            self.exhausted = True


class MeteredMatcher:
    """An xgrammar `GrammarMatcher` (every method of which it offers) that meters its own time,
    `accept_token` and the bitmask fills of `fill_rows`, against its request's budget."""

    def __init__(self, matcher: Any, budget: MatchBudget) -> None:
        self.matcher = matcher
        self.budget = budget

    def __getattr__(self, name: str) -> Any:
        if name == "matcher":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.matcher, name)

    @property
    def over_budget(self) -> bool:
        return self.budget.exhausted

    def accept_token(self, token_id: int) -> bool:
        if self.budget.exhausted:  # (the request is being stopped: its tokens no longer matter)
            return True
        start = time.thread_time()
        try:
            return self.matcher.accept_token(token_id)
        finally:
            self.budget.spend(time.thread_time() - start)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.budget.exhausted:  # (its row stays unconstrained: see the module's docstring)
            return
        start = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.budget.spend(time.thread_time() - start)


def fill_rows(bitmask: torch.Tensor, rows: Iterable[tuple[int, MeteredMatcher]]) -> None:
    """Fill each row's allowed tokens from its matcher, one row at a time so each is metered; each
    request taking part earns one step's allowance (the engine stops the requests over their budget
    after the step)."""
    rows = list(rows)
    for budget in {id(m.budget): m.budget for _, m in rows}.values():
        budget.earn()
    for row, matcher in rows:
        matcher.fill(bitmask, row)


def too_expensive_message() -> str:
    return (
        "structured output: the grammar needs more matching work per step than the server allows a request "
        f"(on average {MATCH_TIME_PER_STEP_S * 1000:g} ms, {MATCH_TIME_BURST_S * 1000:g} ms in bursts): it is "
        "ambiguous or too large; simplify it"
    )
