"""Incremental detokenization: text grows token by token without broken multi-byte characters."""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the new ones, so tokenizers whose pieces depend on their
# left neighbour (SentencePiece leading spaces) produce the right text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        # Streamed text holds back this many characters so a partial stop string is never sent.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add_token(self, token: int) -> str | None:
        """Append a token; returns the stop string if the text now contains one (text is cut there)."""
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        old_len = len(self.text)
        self.text += delta
        return self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None  # the earliest stop string in the text wins
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        return s

    def visible_len(self, finished: bool) -> int:
        """How much of the text may be streamed now."""
        return len(self.text) if finished else max(0, len(self.text) - self.holdback)
