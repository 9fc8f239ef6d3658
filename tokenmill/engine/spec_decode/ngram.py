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

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, max_tokens: int) -> tuple[int, ...]:
    """Up to `max_tokens` tokens that followed an earlier occurrence of the longest suffix n-gram
    (min_n <= n <= max_n) of `token_ids` (see the module docstring); () when none occurs earlier."""
    length = len(token_ids)
    if max_tokens <= 0 or length <= min_n:
        return ()
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting before the suffix itself, so that at least one token follows each.
        windows = sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(starts):
            full = starts[starts <= length - n - max_tokens]
            follow = int(full[-1] if len(full) else starts[0]) + n
            return tuple(tokens[follow : follow + max_tokens].tolist())
    return ()


class NgramProposer:
    """Drafts from the sequence's own tokens, at scheduling time (see `Scheduler`)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def __call__(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        return ngram_lookup(token_ids, self.min_n, self.max_n, max_tokens)
