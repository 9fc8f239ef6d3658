"""`bench serve`'s request trace: synthetic random-token prompts or ShareGPT conversations, sent at
the times of a seeded Poisson process."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# ShareGPT entries shorter than this (in tokens) are dropped: tiny turns measure overhead, not decoding.
MIN_SHAREGPT_TOKENS = 4
# Synthetic output length when --output-len is not given (with --dataset it means "from the data").
SYNTHETIC_OUTPUT_LEN = 128
_HUMAN_ROLES = {"human", "user"}
_GPT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing"}


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the datasets need (tests pass a tiny stand-in)."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of the trace. `prompt_len` is the tokenizer's count; a server's usage wins."""

    prompt: str
    output_len: int
    prompt_len: int | None = None


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from start) of a Poisson process: exponential gaps with mean 1/rate.

    The first request goes at 0; rate inf sends everything at once.
    """
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {request_rate}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """Uniform integers in [mean*(1-r), mean*(1+r)], at least 1; exactly `mean` when r == 0."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def _fit_prompt(tokenizer: Tokenizer, rng: np.random.Generator, vocab: np.ndarray, length: int) -> tuple[str, int]:
    """Random-token text that re-encodes to about `length` tokens.

    Decoding then encoding merges or splits tokens, so the length drifts; truncate or top up a few
    times until it re-encodes to the target (or give up and report the real count).
    """
    ids: list[int] = rng.choice(vocab, size=length).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for _ in range(4):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids = ids + rng.choice(vocab, size=length - len(ids)).tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def synthetic_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random vocabulary tokens (no special tokens), deterministic for a seed."""
    rng = np.random.default_rng(seed)
    in_lens = _sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _sample_lengths(rng, output_len, range_ratio, num_prompts)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        prompt, real_len = _fit_prompt(tokenizer, rng, vocab, n_in)
        requests.append(BenchRequest(prompt=prompt, output_len=n_out, prompt_len=real_len))
    return requests


def _first_exchange(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first human turn and the gpt turn answering it, or None if the entry has no such pair."""
    turns = entry.get("conversations") or entry.get("conversation") or []
    for i, turn in enumerate(turns):
        if str(turn.get("from", "")).lower() in _HUMAN_ROLES:
            for reply in turns[i + 1 :]:
                if str(reply.get("from", "")).lower() in _GPT_ROLES:
                    return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def load_sharegpt(
    path: str | Path,
    tokenizer: Tokenizer,
    num_prompts: int | None,
    seed: int = 0,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """Requests from a ShareGPT-style JSON list, shuffled with `seed`.

    The output length is the gpt turn's token count unless `output_len` fixes it; pairs shorter than
    MIN_SHAREGPT_TOKENS, or longer than `max_model_len` in total, are skipped.
    """
    entries = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries")
    pairs = [p for p in (_first_exchange(e) for e in entries if isinstance(e, dict)) if p is not None]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, completion in pairs:
        if num_prompts is not None and len(requests) >= num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if prompt_len < MIN_SHAREGPT_TOKENS or out_len < MIN_SHAREGPT_TOKENS:
            continue
        if max_model_len is not None and prompt_len + out_len > max_model_len:
            continue
        requests.append(BenchRequest(prompt=prompt, output_len=out_len, prompt_len=prompt_len))
    if not requests:
        raise ValueError(f"{path}: no usable human/gpt conversation pairs")
    return requests


def load_tokenizer(path: str | Path | None) -> Any:
    """A Hugging Face tokenizer from a model directory; None means the bundled default model."""
    from transformers import AutoTokenizer

    from tokenmill.models.model_loader.hub import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(path))


def requests_from_args(args: argparse.Namespace, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The request trace the workload flags describe: a ShareGPT file if --dataset, else synthetic."""
    if args.dataset:
        return load_sharegpt(args.dataset, tokenizer, args.num_prompts, seed=args.seed, output_len=args.output_len)
    return synthetic_requests(
        tokenizer,
        args.num_prompts,
        args.input_len,
        args.output_len or getattr(args, "synthetic_output_len", SYNTHETIC_OUTPUT_LEN),
        range_ratio=args.range_ratio,
        seed=args.seed,
    )


def warmup_requests(requests: Sequence[BenchRequest], count: int) -> list[BenchRequest]:
    """Untimed requests shaped like the trace's first `count`, with their prompts reversed: sending
    the trace's own prompts first would let a server's prefix cache answer them in the timed run."""
    return [BenchRequest(prompt=r.prompt[::-1], output_len=r.output_len) for r in requests[:count]]


def describe_trace(requests: Sequence[BenchRequest], request_rate: float, max_concurrency: int | None) -> str:
    in_lens = [r.prompt_len or 0 for r in requests]
    out_lens = [r.output_len for r in requests]
    return (
        f"{len(requests)} requests, prompt tokens {min(in_lens)}-{max(in_lens)}, "
        f"output tokens {min(out_lens)}-{max(out_lens)}, rate {request_rate} req/s, "
        f"max concurrency {max_concurrency or 'unbounded'}"
    )
