"""N-gram prompt lookup: draft tokens without a draft model.

Text that quotes or rewrites its prompt (code edits, summaries, extraction) repeats spans of it. If
the last n tokens of a sequence occurred earlier in its prompt or output, the tokens that followed
them then are a good guess for what follows now. Longer n-grams are tried first (a longer match is
stronger evidence); among the occurrences of one n-gram the most recent one followed by a full
proposal wins (in a run of one repeated token the most recent occurrence is followed by a single
token), else the earliest (followed by the most tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np


def ngram_lookup(token_ids: Sequence[int] | np.ndarray, min_n: int, max_n: int, max_tokens: int) -> tuple[int, ...]:
    """Up to `max_tokens` tokens that followed an earlier occurrence of the longest suffix n-gram
    (min_n <= n <= max_n) of `token_ids` (see the module docstring); () when none occurs earlier."""
    length = len(token_ids)
    if max_tokens <= 0 or length <= min_n:
        return ()
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Where an earlier occurrence can end: the last token again, with a token after it. Each
    # longer n-gram is checked one more token back, on the candidates still matching.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    matched = [ends]
    for back in range(1, min(max_n, length - 1)):
        ends = ends[ends >= back]
        ends = ends[tokens[ends - back] == tokens[length - 1 - back]]
        matched.append(ends)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        ends = matched[n - 1]
        if len(ends):
            full = ends[ends <= length - 1 - max_tokens]
            follow = int(full[-1] if len(full) else ends[0]) + 1
            return tuple(tokens[follow : follow + max_tokens].tolist())
    return ()


class NgramProposer:
    """Drafts from the sequence's own tokens, at scheduling time (see `Scheduler`). Each
    sequence's tokens are kept as an array, extended by the tokens appended since its last lookup,
    so a step does not convert every context from scratch."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._arrays: WeakKeyDictionary[Any, np.ndarray] = WeakKeyDictionary()  # sequence -> its tokens

    def __call__(self, seq: Any, max_tokens: int) -> tuple[int, ...]:
        return ngram_lookup(self._tokens(seq), self.min_n, self.max_n, max_tokens)

    def _tokens(self, seq: Any) -> np.ndarray:
        """`seq.token_ids` as an array. Only looked up with every token resolved (no placeholders),
        and a sequence's resolved tokens never change: only new ones are converted."""
        cached, count = self._arrays.get(seq), len(seq.token_ids)
        if cached is None or len(cached) > count:  # (a taken-back step dropped tokens)
            cached = np.asarray(seq.token_ids, dtype=np.int64)
        elif len(cached) < count:
            cached = np.concatenate([cached, np.asarray(seq.token_ids[len(cached) :], dtype=np.int64)])
        self._arrays[seq] = cached
        return cached
