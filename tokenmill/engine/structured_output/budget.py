"""How much grammar work one sequence may cost the engine per token.

Matching is done on the scheduling thread: advancing a sequence's matcher by its sampled token and
filling its row of the next step's bitmask. For most grammars that takes microseconds, but an
ambiguous grammar's matcher state can grow with every token (`root ::= b* "y"`, `b ::= "x"*
"x"* "x"*`: over a second per token after ~100 tokens), and a large `anyOf` costs tens of
milliseconds per row: every other stream's inter-token gap would grow by as much. So each
sequence's matcher time is metered with a token bucket: it earns MATCH_TIME_PER_TOKEN_S per token,
may hold at most MATCH_TIME_BURST_S of credit, and is stopped (the engine fails its request with
`GrammarTooExpensive`) once its credit runs out. Time is the thread's CPU time, so a busy machine
preempting the engine thread mid-call costs no request its budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from tokenmill.errors import InvalidRequest

MATCH_TIME_PER_TOKEN_S = 0.005
MATCH_TIME_BURST_S = 0.1


class GrammarTooExpensive(InvalidRequest):
    """The request's grammar needs more matching work per token than the engine gives a sequence."""

    code = "grammar_too_expensive"


class MeteredMatcher:
    """An xgrammar `GrammarMatcher` (every method of which it offers) that meters its own time:
    `accept_token`, and the bitmask fills of `fill_rows`, against its sequence's budget."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.credit = MATCH_TIME_BURST_S
        self.over_budget = False

    def __getattr__(self, name: str) -> Any:
        if name == "matcher":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.matcher, name)

    def accept_token(self, token_id: int) -> bool:
        start = time.thread_time()
        try:
            return self.matcher.accept_token(token_id)
        finally:
            self.spend(time.thread_time() - start)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.credit = min(MATCH_TIME_BURST_S, self.credit + MATCH_TIME_PER_TOKEN_S)  # this token's allowance
        start = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.spend(time.thread_time() - start)

    def spend(self, seconds: float) -> None:
        self.credit -= seconds
        if self.credit < 0:
            self.over_budget = True


def fill_rows(bitmask: torch.Tensor, rows: Iterable[tuple[int, MeteredMatcher]]) -> None:
    """Fill each row's allowed tokens from its matcher, one row at a time so each is metered (the
    engine stops the requests of matchers over their budget after the step)."""
    for row, matcher in rows:
        matcher.fill(bitmask, row)


def too_expensive_message() -> str:
    return (
        "structured output: the grammar needs more matching work per token than the server allows "
        f"(on average {MATCH_TIME_PER_TOKEN_S * 1000:g} ms, {MATCH_TIME_BURST_S * 1000:g} ms in bursts): "
        "it is ambiguous or too large; simplify it"
    )
