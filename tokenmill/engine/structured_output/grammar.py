"""Grammar-constrained decoding with xgrammar: compiling off the engine thread, and the per-step
allowed-token bitmask.

* `GrammarCompiler` compiles each spec once (an LRU of futures keyed by the spec) on a small thread
  pool: xgrammar releases the GIL while it compiles, so a schema that takes seconds never stalls
  the engine loop. The engine keeps a request out of the scheduler until its grammar is ready.
* Each constrained sequence owns an `xgrammar.GrammarMatcher`, advanced only where the scheduler
  lands sampled tokens (through `StructuredOutputManager.accept`): its state always matches the
  sequence's known output tokens (preemption keeps them; taken-back steps never reached it).
* A step's `GrammarMask` is the bitmask of all its constrained rows, filled in one batched call by
  the scheduling thread as soon as every earlier token of those rows is known: at launch without
  overlap scheduling, or after the previous step lands with it. The model thread runs the forward
  pass meanwhile and waits for the mask only when it samples.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tokenmill.engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2
CACHE_ENTRIES = 256


class GrammarCompiler:
    """Compiles specs against one model's vocabulary, once per spec, off the calling thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        max_entries: int = CACHE_ENTRIES,
        threads: int = COMPILE_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width): may exceed the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(threads, "tokenmill-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._compiler: Any = None  # built on first use, on a pool thread (it reads the whole vocabulary)
        self._compiler_lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (already done when the spec was compiled before).
        Called from one thread (the engine's)."""
        key = spec.key
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._cache[key] = self._pool.submit(self._compile, spec)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)  # requests waiting on it keep their own reference
        return future

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher (one per sequence) at the start of the grammar."""
        import xgrammar as xgr

        # Without stop tokens the grammar's end must end the sequence by itself.
        return xgr.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        return self._xgr_compiler().compile_grammar(spec.validate())

    def _xgr_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # One compile at a time per pool thread; our own LRU caches results.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, without the special tokens: xgrammar would match a special
    token's text (a choice "<|im_end|>" could be written as that one control token), which the
    output text then leaves out. Tokens with an empty text are never allowed, except the stop
    tokens at the end."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            vocab[index] = token
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for index in special - set(stop_token_ids):
        if index < vocab_size:
            vocab[index] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, base.dump_metadata())


class GrammarMask:
    """The allowed-token bitmask of one step's constrained sampling rows (rows of `SamplingInput`).
    Filled once by the scheduling thread (`fill`); the sampler waits for it (`wait`)."""

    def __init__(self, rows: tuple[int, ...], num_rows: int, vocab_size: int, items: tuple[int, ...]) -> None:
        self.rows = rows
        self.items = items  # the step's sampled sequence (`SchedulerOutput.sampled` index) of each row
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self._result: Future = Future()

    @property
    def filled(self) -> bool:
        return self._result.done()

    def fill(self, matchers: list[Any | None]) -> None:
        """`matchers[i]`: the matcher of row `rows[i]` (of sequence `items[i]`), at the state before this
        step's token, or None for a row whose sequence ended meanwhile (its token is discarded: left unmasked)."""
        if self.filled:
            return
        try:
            import xgrammar as xgr

            bitmask = xgr.allocate_token_bitmask(self.num_rows, self.vocab_size)  # all allowed
            live = [(row, m) for row, m in zip(self.rows, matchers) if m is not None and not m.is_terminated()]
            if live:
                rows, live_matchers = zip(*live)
                _batch_matcher().batch_fill_next_token_bitmask(list(live_matchers), bitmask, list(rows))
            self._result.set_result((bitmask, [row for row, _ in live]))
        except Exception as exc:
            logger.exception("filling a grammar mask failed")
            self._result.set_exception(exc)

    def cancel(self, reason: str) -> None:
        """Never filled (the step was taken back, or the engine is closing): release the waiter."""
        if not self.filled:
            self._result.set_exception(RuntimeError(reason))

    def wait(self) -> tuple[torch.Tensor, list[int]]:
        """(bitmask [num_rows, ceil(vocab / 32)] int32 on the host, the rows it constrains)."""
        return self._result.result()


_BATCH_MATCHER: Any = None


def _batch_matcher() -> Any:
    global _BATCH_MATCHER
    if _BATCH_MATCHER is None:
        import xgrammar as xgr

        _BATCH_MATCHER = xgr.BatchGrammarMatcher()
    return _BATCH_MATCHER


def apply_mask(logits: torch.Tensor, mask: GrammarMask, vocab_size: int) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the constrained rows (one kernel)."""
    import xgrammar as xgr

    bitmask, rows = mask.wait()
    if rows:
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size, indices=rows
        )
