"""Grammar-constrained decoding with xgrammar: compiling off the engine thread, and the per-step
allowed-token bitmask.

* `GrammarCompiler` compiles each spec once, off the engine thread (the engine keeps a request out
  of the scheduler until its grammar is ready), within bounds no spec can break:
  - a trial compile first, in a worker process (`compile_worker`) that is killed at the deadline
    (COMPILE_TIMEOUT_S of its CPU time, and WALL_FACTOR times as much wall time: the request gets
    a 400), or as soon as every request waiting for it has gone (abort, client disconnect); a
    grammar that would hold more than MAX_GRAMMAR_BYTES is refused there too. Only a grammar that
    passed is compiled again in this process (about as fast: compiling is deterministic; not at a
    lower priority: a Python thread that holds the GIL must not wait for the CPU);
  - lanes: every spec starts in the light lane, whose worker gives it LIGHT_BUDGET_S; one that
    needs more (or is larger than LIGHT_MAX_SPEC_BYTES) goes to the heavy lane, served by the other
    workers and its own build thread: expensive grammars queue among themselves, never ahead of
    cheap ones;
  - compiled grammars are cached by spec, bounded by their memory (CACHE_BYTES, least recently used
    evicted first) and count (CACHE_ENTRIES). A build leaves several times the grammar's size freed
    in the allocator's arenas: the engine hands it back to the system when it is idle
    (`heap.trim_heap`).
* Each constrained sequence owns a matcher (`budget.MeteredMatcher`), advanced only where the
  scheduler lands sampled tokens (through `StructuredOutputManager.accept`): its state always
  matches the sequence's known output tokens (preemption keeps them; taken-back steps never
  reached it). Its time is metered against its request's budget (see `budget`).
* A step's `GrammarMask` is the bitmask of all its constrained rows, filled by the scheduling
  thread as soon as every earlier token of those rows is known: at launch without overlap
  scheduling, or after the previous step lands with it. The model thread runs the forward pass
  meanwhile and waits for the mask only when it samples.
"""

from __future__ import annotations

import hashlib
import logging
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import IO, Any

import psutil
import torch

from tokenmill.engine.structured_output import compile_worker
from tokenmill.engine.structured_output.budget import MatchBudget, MeteredMatcher, fill_rows
from tokenmill.engine.structured_output.params import SpecKey, StructuredOutputsParams
from tokenmill.errors import InvalidRequest

logger = logging.getLogger(__name__)

WORKERS = 2
COMPILE_TIMEOUT_S = 15.0
LIGHT_BUDGET_S = 0.5
LIGHT_MAX_SPEC_BYTES = 16 << 10
WALL_FACTOR = 4.0
MAX_GRAMMAR_BYTES = 64 << 20
CACHE_BYTES = 128 << 20
CACHE_ENTRIES = 256
WORKER_START_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh process, on a busy machine
VOCABULARIES = 4  # tokenizer infos kept for engines made again over the same tokenizer (tokenizer_info)
_POLL_S = 0.05  # how often a trial checks whether anyone still waits for it


class GrammarTooComplex(InvalidRequest):
    """A spec whose grammar takes too long to compile, or would hold too much memory."""

    code = "structured_output_too_complex"


class _Withdrawn(Exception):
    """Every request waiting for the compile has gone."""


@dataclass(eq=False)
class _Job:
    """One spec's compile, shared by every request that asks for the same spec."""

    key: SpecKey
    grammar: Any  # the parsed spec (an xgrammar Grammar)
    heavy: bool
    trusted: bool  # compiled here directly, without a trial (the built-in JSON grammar)
    waiters: set[Future] = field(default_factory=set)
    running: bool = False
    compiled: Any = None
    error: BaseException | None = None
    size: int = 0  # the compiled grammar's bytes

    @property
    def finished(self) -> bool:
        return self.compiled is not None or self.error is not None

    @property
    def param(self) -> str:
        return f"structured_outputs.{self.key[0]}"


class GrammarCompiler:
    """Compiles specs against one model's vocabulary, once per spec (see the module's docstring).
    `compile` and `matcher` are called from the engine thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        max_entries: int = CACHE_ENTRIES,
        max_bytes: int = CACHE_BYTES,
        timeout_s: float = COMPILE_TIMEOUT_S,
        workers: int = WORKERS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (logits width): may exceed the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._lock = threading.Condition(threading.RLock())
        self._cache: OrderedDict[SpecKey, _Job] = OrderedDict()
        # Queues: trials by lane (light, heavy), then builds by lane.
        self._trials: tuple[deque[_Job], deque[_Job]] = (deque(), deque())
        self._builds: tuple[deque[_Job], deque[_Job]] = (deque(), deque())
        self._xgr: Any = None  # xgrammar's compiler over the vocabulary (built once) and
        self._info: Any = None  # the vocabulary (its TokenizerInfo)
        self._xgr_lock = threading.Lock()
        # Worker 0 takes light trials only, the others heavy ones first.
        self._workers = [_Worker(lambda: self._compiler()[1]) for _ in range(max(2, workers))]
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(job.size for job in self._cache.values())

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar, this caller's own: cancelling it withdraws the caller,
        and a compile nobody waits for is stopped. Already done when the spec was compiled before."""
        waiter: Future = Future()
        with self._lock:
            job = self._cache.get(spec.key)
            if job is None or (job.error is not None and not isinstance(job.error, InvalidRequest)):
                job = self._add(spec)  # (a failure that is no fault of the spec is tried again)
            else:
                self._cache.move_to_end(spec.key)
            if job.finished:
                _settle(waiter, job)
                return waiter
            job.waiters.add(waiter)
            waiter.add_done_callback(lambda done: self._withdraw(job, done))
            self._start_threads()
            self._lock.notify_all()
        return waiter

    def warm(self) -> None:
        """Start the worker processes now, in the background (a server does: its first constrained
        request then waits for no process to import xgrammar); otherwise the first compile does."""
        with self._lock:
            self._start_threads()

    def matcher(self, compiled: Any, budget: MatchBudget | None = None) -> MeteredMatcher:
        """A fresh matcher (one per sequence) at the start of the grammar, metered against `budget`
        (one per request, shared by its sequences; None: a budget of its own)."""
        import xgrammar as xgr

        # Without stop tokens the grammar's end must end the sequence by itself.
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_token_ids)
        return MeteredMatcher(matcher, budget or MatchBudget())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queued = [job for queue in (*self._trials, *self._builds) for job in queue]
            for queue in (*self._trials, *self._builds):
                queue.clear()
            self._lock.notify_all()
        for job in queued:
            self._finish(job, error=RuntimeError("the engine is closing"))
        for worker in self._workers:  # (a trial in progress ends: its thread sees the process gone)
            worker.stop()
        for thread in self._threads:
            thread.join(timeout=10)

    # -- queues ---------------------------------------------------------------------------------

    def _add(self, spec: StructuredOutputsParams) -> _Job:
        trusted = spec.kind == "json_object"
        job = _Job(spec.key, spec.validate(), heavy=len(spec.key[1]) > LIGHT_MAX_SPEC_BYTES, trusted=trusted)
        self._cache[spec.key] = job
        self._evict()
        (self._builds if trusted else self._trials)[job.heavy].append(job)
        return job

    def _withdraw(self, job: _Job, waiter: Future) -> None:
        """A waiter's future is done: when it was cancelled and was the last, the compile stops (a
        queued one is dropped; a trial's process is killed; a build, bounded by its trial, ends)."""
        if not waiter.cancelled():
            return
        with self._lock:
            job.waiters.discard(waiter)
            if not job.waiters and not job.finished and not job.running:
                self._forget(job)

    def _forget(self, job: _Job) -> None:
        for queue in (*self._trials, *self._builds):
            if job in queue:
                queue.remove(job)
        if self._cache.get(job.key) is job:
            del self._cache[job.key]

    def _take(self, queues: tuple[deque[_Job], ...]) -> _Job | None:
        """The next job of the first non-empty queue (waits for one; None once closed)."""
        with self._lock:
            while not self._closed:
                queue = next((q for q in queues if q), None)
                if queue is not None:
                    job = queue.popleft()
                    job.running = True
                    return job
                self._lock.wait()
            return None

    def _start_threads(self) -> None:
        """On the first compile: a thread per worker process, and a build thread per lane."""
        if self._threads:
            return
        light, heavy = self._trials
        targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (self._serve_trials, (index, (light,) if index == 0 else (heavy, light)))
            for index in range(len(self._workers))
        ]
        targets += [(self._serve_builds, (lane,)) for lane in (0, 1)]
        for target, args in targets:
            thread = threading.Thread(target=target, args=args, name="tokenmill-grammar", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _requeue(self, job: _Job, queue: deque[_Job]) -> None:
        with self._lock:
            job.running = False
            if not job.waiters:
                self._forget(job)
                return
            queue.append(job)
            self._lock.notify_all()

    # -- trials (worker processes) --------------------------------------------------------------

    def _serve_trials(self, index: int, queues: tuple[deque[_Job], ...]) -> None:
        worker = self._workers[index]
        light_only = index == 0
        try:
            worker.warm()
            while (job := self._take(queues)) is not None:
                self._trial(job, worker, light_only)
                if not self._closed:
                    worker.warm()  # a killed process's replacement starts now, not with the next compile
        finally:
            worker.stop()

    def _trial(self, job: _Job, worker: _Worker, light_only: bool) -> None:
        # On a worker that takes heavy trials a light one gets the full deadline at once.
        budget = min(LIGHT_BUDGET_S, self.timeout_s) if light_only else self.timeout_s
        try:
            reply = worker.trial(job.grammar.serialize_json().encode(), budget, lambda: not job.waiters)
        except _Withdrawn:
            self._requeue(job, self._trials[job.heavy])  # (dropped, unless a waiter came back meanwhile)
            return
        except TimeoutError:
            if light_only:  # over the light budget: the heavy lane tries again with the full deadline
                job.heavy = True
                self._requeue(job, self._trials[1])
                return
            reply = {"status": "timeout"}
        except Exception as exc:  # the process died (out of memory, a crash) or could not start
            logger.warning("compiling a grammar failed: %s", exc)
            reply = {"status": "error", "message": str(exc)}
        status = reply["status"]
        if status == "ok":
            self._requeue(job, self._builds[job.heavy])
        elif status == "timeout":
            message = f"the grammar did not compile within {self.timeout_s:g} s: simplify it"
            self._finish(job, error=GrammarTooComplex(message, param=job.param))
        elif status == "too_large":
            message = (
                f"the compiled grammar would take {reply['size'] / 2**20:.1f} MiB; the limit is "
                f"{MAX_GRAMMAR_BYTES / 2**20:.1f} MiB: simplify it"
            )
            self._finish(job, error=GrammarTooComplex(message, param=job.param))
        else:
            self._finish(job, error=RuntimeError(f"the grammar could not be compiled: {reply.get('message')}"))

    # -- builds (this process) ------------------------------------------------------------------

    def _serve_builds(self, lane: int) -> None:
        while (job := self._take((self._builds[lane],))) is not None:
            try:
                compiled = self._compiler()[0].compile_grammar(job.grammar)
            except Exception as exc:  # (passed its trial: not the spec's fault)
                logger.exception("compiling a grammar failed")
                self._finish(job, error=RuntimeError(f"the grammar could not be compiled: {exc}"))
                continue
            self._finish(job, compiled=compiled)

    def _compiler(self) -> tuple[Any, Any]:
        """(xgrammar's GrammarCompiler, its TokenizerInfo)."""
        with self._xgr_lock:
            if self._xgr is None:
                import xgrammar as xgr

                self._info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._xgr = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)  # our cache instead
            return self._xgr, self._info

    def _finish(self, job: _Job, compiled: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            job.compiled, job.error, job.running = compiled, error, False
            job.size = compiled.memory_size_bytes if compiled is not None else 0
            waiters, job.waiters = list(job.waiters), set()
            self._evict()
        for waiter in waiters:
            _settle(waiter, job)

    def _evict(self) -> None:
        """Drop the least recently used finished grammars while the cache holds too many or too
        many bytes (requests running with one keep it alive through their matchers)."""
        total = sum(job.size for job in self._cache.values())
        for key, job in list(self._cache.items()):
            if total <= self.max_bytes and len(self._cache) <= self.max_entries:
                return
            if job.finished:
                del self._cache[key]
                total -= job.size


class _Worker:
    """One trial process, started on first use and replaced after it is killed."""

    def __init__(self, tokenizer_info: Callable[[], Any]) -> None:
        self._tokenizer_info = tokenizer_info  # the vocabulary the process compiles against
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def trial(self, grammar_json: bytes, timeout_s: float, withdrawn: Callable[[], bool]) -> dict[str, Any]:
        """The reply to one trial compile (see compile_worker). TimeoutError past `timeout_s` of its
        CPU time (or WALL_FACTOR times as much wall time), _Withdrawn once `withdrawn()`: the process
        is killed either way."""
        proc = self._started()
        stdin, stdout = _pipes(proc)
        usage = psutil.Process(proc.pid)
        cpu_start, wall_deadline = _cpu_seconds(usage), time.monotonic() + WALL_FACTOR * timeout_s
        compile_worker.write_frame(stdin, {"max_bytes": MAX_GRAMMAR_BYTES}, grammar_json)
        while not select.select([stdout], [], [], _POLL_S)[0]:
            if withdrawn():
                self._kill()
                raise _Withdrawn()
            if _cpu_seconds(usage) - cpu_start > timeout_s or time.monotonic() > wall_deadline:
                self._kill()
                raise TimeoutError()
        reply = compile_worker.read_frame(stdout)
        if reply is None:
            self._kill()
            raise RuntimeError(f"the compiler process died (exit code {proc.poll()})")
        return reply[0]

    def warm(self) -> None:
        """Start the process now if it is not running (errors surface with the next trial)."""
        try:
            self._started()
        except Exception as exc:
            logger.debug("the grammar compiler process did not start: %s", exc)

    def stop(self) -> None:
        self._kill()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-m", compile_worker.__name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        stdin, stdout = _pipes(proc)
        info = self._tokenizer_info().serialize_json().encode()
        compile_worker.write_frame(stdin, {}, info)
        ready, _, _ = select.select([stdout], [], [], WORKER_START_TIMEOUT_S)
        reply = compile_worker.read_frame(stdout) if ready else None
        if reply is None or reply[0].get("status") != "ready":
            self._kill()
            raise RuntimeError("the compiler process did not start")
        return proc

    def _kill(self) -> None:
        with self._lock:  # (close() may stop a process its thread is using)
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in _pipes(proc):
                pipe.close()


def _pipes(proc: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    assert proc.stdin is not None and proc.stdout is not None  # (started with both)
    return proc.stdin, proc.stdout


def _cpu_seconds(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:  # (it has just exited: its reply is about to be read)
        return 0.0
    return times.user + times.system


def _settle(waiter: Future, job: _Job) -> None:
    if waiter.done():
        return
    try:
        if job.error is not None:
            waiter.set_exception(job.error)
        else:
            waiter.set_result(job.compiled)
    except Exception:  # (InvalidStateError: cancelled meanwhile)
        pass


_vocabularies: OrderedDict[tuple[Any, ...], Any] = OrderedDict()  # tokenizer_info's, least recently used first
_vocabularies_lock = threading.Lock()


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, without the special tokens: xgrammar would match a special
    token's text (a choice "<|im_end|>" could be written as that one control token), which the
    output text then leaves out. Tokens with an empty text are never allowed, except the stop
    tokens at the end. Building it decodes every token: a fast tokenizer's is built once per
    process (by content: `_vocabulary_key`), so an engine made again over the same model reuses it."""
    key = _vocabulary_key(tokenizer, vocab_size, stop_token_ids)
    if key is None:
        return _build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
    with _vocabularies_lock:
        info = _vocabularies.get(key)
        if info is None:
            info = _vocabularies[key] = _build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
            while len(_vocabularies) > VOCABULARIES:
                _vocabularies.popitem(last=False)
        _vocabularies.move_to_end(key)
        return info


def _vocabulary_key(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> tuple[Any, ...] | None:
    """Everything tokenizer_info reads of a fast tokenizer: its serialized form (vocabulary, added
    tokens and which are special, pre-tokenizer and decoder), its special and eos ids; None for
    other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return (
        type(tokenizer).__qualname__,
        hashlib.sha256(backend.to_str().encode()).digest(),
        tuple(sorted(tokenizer.all_special_ids)),
        tokenizer.eos_token_id,
        vocab_size,
        tuple(stop_token_ids),
    )


def _build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    vocab: list[bytes | str] = [""] * vocab_size
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
            fill_rows(bitmask, live)
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


def apply_mask(logits: torch.Tensor, mask: GrammarMask, vocab_size: int) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the constrained rows (one kernel)."""
    import xgrammar as xgr

    bitmask, rows = mask.wait()
    if rows:
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size, indices=rows
        )
