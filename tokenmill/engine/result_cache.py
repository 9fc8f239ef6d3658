"""An LRU of finished completions for identical deterministic requests (`--result-cache-size`).

A request is deterministic when every choice is greedy or seeded: the same prompt tokens and
the same sampling parameters then ask for the same completion, so a repeat is answered from
memory without touching the scheduler or the model. Unseeded sampling is never cached (each call
must draw anew), and only requests that finished normally ("stop"/"length") are stored.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace

from tokenmill.engine.outputs import CompletionOutput
from tokenmill.engine.sampling_params import SamplingParams

CacheKey = tuple[tuple[int, ...], str, int | None]  # prompt, sampling params, LoRA adapter id
_CACHEABLE_FINISH = ("stop", "length")


@dataclass
class ResultCacheStats:
    hits: int = 0
    misses: int = 0  # deterministic requests looked up and not found (uncacheable ones are not counted)
    entries: int = 0


class ResultCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("--result-cache-size must be >= 0")
        self.capacity = capacity
        self._entries: OrderedDict[CacheKey, list[CompletionOutput]] = OrderedDict()
        self._lock = threading.Lock()  # stats() is read from the metrics thread
        self._hits = 0
        self._misses = 0

    def key(self, prompt_token_ids: list[int], params: SamplingParams, lora_id: int | None = None) -> CacheKey | None:
        """The lookup key, or None when the request must not be served from the cache. `lora_id`: the
        LoRA adapter it runs with (another adapter, another completion)."""
        if self.capacity == 0 or not params.deterministic or params.prompt_logprobs is not None:
            return None  # (prompt logprobs are not stored: such requests always run)
        return tuple(prompt_token_ids), json.dumps(asdict(params), sort_keys=True), lora_id

    def get(self, key: CacheKey) -> list[CompletionOutput] | None:
        with self._lock:
            outputs = self._entries.get(key)
            if outputs is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
        # Fresh copies: callers may consume deltas or mutate lists of what they receive.
        return [_replayed(o) for o in outputs]

    def put(self, key: CacheKey, outputs: list[CompletionOutput]) -> bool:
        """Store a finished request's choices; refused unless every choice ended normally."""
        if any(o.finish_reason not in _CACHEABLE_FINISH for o in outputs):
            return False
        stored = [
            replace(
                o,
                token_ids=list(o.token_ids),
                text_delta="",
                token_ids_delta=[],
                logprobs=list(o.logprobs) if o.logprobs is not None else None,
                logprobs_delta=None,
            )
            for o in outputs
        ]
        with self._lock:
            self._entries[key] = stored
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return True

    def stats(self) -> ResultCacheStats:
        with self._lock:
            return ResultCacheStats(self._hits, self._misses, len(self._entries))


def _replayed(o: CompletionOutput) -> CompletionOutput:
    """A cached choice as one final output: everything is new to this caller."""
    logprobs = list(o.logprobs) if o.logprobs is not None else None
    return replace(
        o,
        token_ids=list(o.token_ids),
        text_delta=o.text,
        token_ids_delta=list(o.token_ids),
        logprobs=logprobs,
        logprobs_delta=list(logprobs) if logprobs is not None else None,
    )
