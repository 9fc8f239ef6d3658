"""Token ids -> text: incremental detokenization with stop strings, and per-token strings/bytes.

`IncrementalDetokenizer` follows one sequence with tokenizers' `DecodeStream` (which holds back
incomplete UTF-8 and handles SentencePiece's leading spaces from a few prompt tokens of context).
Its work per token is bounded by the new text and the stop-string holdback, never by the text so
far: pieces are kept in a list and only joined when a caller asks for the whole text.

`TokenText` names single tokens (logprobs): each id is decoded once per engine, with the exact
bytes of tokens that hold part of a UTF-8 character.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Tokens of context decoded before the new ones, so tokenizers whose pieces depend on their
# left neighbour (SentencePiece leading spaces) produce the right text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: tuple[int, ...] | list[int],
        stop: list[str],
        include_stop: bool,
        skip_special_tokens: bool = True,
        silent_token_ids: Iterable[int] = (),
    ) -> None:
        """`skip_special_tokens=False` keeps special tokens in the text, except `silent_token_ids`
        (the EOS that ends the sequence)."""
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self._silent = frozenset() if skip_special_tokens else frozenset(silent_token_ids)
        self._pieces: list[str] = []  # the text so far, in the order decoded
        self._length = 0
        self._taken = 0  # characters handed out by take_delta
        self.stop = stop
        self.include_stop = include_stop
        # Streamed text holds back this many characters so a partial stop string is never sent.
        self.holdback = max((len(s) for s in stop), default=1) - 1

    @property
    def text(self) -> str:
        """All text so far (joins the pieces: O(length), for final or cumulative outputs)."""
        return "".join(self._pieces)

    def add_token(self, token: int) -> str | None:
        """Append a token; returns the stop string if the text now contains one (text is cut there)."""
        if token in self._silent:
            return None
        delta = self._stream.step(self._backend, token)
        if not delta:
            return None  # an incomplete UTF-8 sequence (or a skipped special token): wait for more
        self._pieces.append(delta)
        self._length += len(delta)
        return self._check_stop(len(delta)) if self.stop else None

    def _check_stop(self, new_chars: int) -> str | None:
        # A stop string ending in the new text starts at most holdback characters before it.
        window = self._suffix(new_chars + self.holdback)
        window_start = self._length - len(window)
        first_new = len(window) - new_chars
        best: tuple[int, str] | None = None  # the earliest stop string in the text wins
        for s in self.stop:
            idx = window.find(s, max(0, first_new - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self._truncate(window_start + idx + (len(s) if self.include_stop else 0))
        return s

    def _suffix(self, n: int) -> str:
        """The last `n` characters of the text (touches only the pieces that hold them)."""
        parts, size = [], 0
        for piece in reversed(self._pieces):
            if size >= n:
                break
            parts.append(piece)
            size += len(piece)
        tail = "".join(reversed(parts))
        return tail[len(tail) - min(n, len(tail)) :]

    def _truncate(self, length: int) -> None:
        while self._pieces and self._length - len(self._pieces[-1]) >= length:
            self._length -= len(self._pieces.pop())
        if self._length > length:
            last = self._pieces[-1]
            self._pieces[-1] = last[: len(last) - (self._length - length)]
            self._length = length
        self._taken = min(self._taken, self._length)

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet that may be streamed now (all of it once finished)."""
        visible = self._length if finished else max(self._taken, self._length - self.holdback)
        delta = self._suffix(self._length - self._taken)[: visible - self._taken]
        self._taken = visible
        return delta

    @property
    def visible_text(self) -> str:
        """The text handed out by take_delta so far."""
        return self.text[: self._taken]


# Byte-level BPE spells tokens in GPT-2's printable stand-ins for the 256 byte values.
_BYTE_LEVEL = {char: byte for byte, char in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback tokens


class TokenText:
    """Token id -> (text, UTF-8 bytes), computed once per id. `text` is the token decoded alone (a
    token holding part of a character decodes to U+FFFD); `bytes` are the token's own bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._decode(token_id)
        return entry

    def _decode(self, token_id: int) -> tuple[str, bytes]:
        text = self._tokenizer.decode([token_id])
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                return text, bytes(_BYTE_LEVEL[c] for c in piece)
            fallback = _BYTE_FALLBACK.match(piece)
            if fallback:
                return text, bytes([int(fallback.group(1), 16)])
        return text, text.encode("utf-8")
