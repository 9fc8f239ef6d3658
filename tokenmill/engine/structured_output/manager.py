"""Structured outputs from a request's arrival to its last token, in one place (vLLM's
`StructuredOutputManager`), on the engine thread:

* the wait-list: a constrained request's grammar compiles on `GrammarCompiler`'s threads while the
  request waits here and the engine steps the others; `take_ready` hands it over with a fresh
  matcher per choice once its grammar is compiled, or reports why it never will be (a spec too
  costly to compile is the request's fault: a rejection); a request that ends while it waits
  withdraws from the compile (`withdraw`), which stops when nobody else waits for it;
* masks: a step's `GrammarMask` (its constrained sampling rows) is filled from those rows'
  matchers (`fill_mask`) once every earlier token of theirs has landed;
* token acceptance: the scheduler lands each sampled token through `accept`, which advances the
  sequence's matcher, and asks `is_complete` whether the grammar has ended the output;
* cost: a request's matcher work (all its choices together) is metered against its budget
  (`budget.MatchBudget`); the engine stops a request `over_budget`.

A matcher always stands at the state after its sequence's landed output tokens: preemption keeps
them, and a step that was taken back never reached it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from tokenmill.engine.structured_output.budget import MatchBudget
from tokenmill.engine.structured_output.grammar import GrammarCompiler, GrammarMask
from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.errors import InvalidRequest


class ConstrainedSeq(Protocol):
    """A choice whose tokens a grammar constrains."""

    grammar: Any  # its xgrammar matcher (this manager's state for it; None until its grammar is compiled)

    @property
    def is_finished(self) -> bool: ...


class ConstrainedRequest(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def seqs(self) -> Seq[ConstrainedSeq]: ...


R = TypeVar("R", bound=ConstrainedRequest)


@dataclass(frozen=True)
class _Compiling(Generic[R]):
    request: R
    grammar: Future  # -> the compiled grammar


class StructuredOutputManager(Generic[R]):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Seq[int]) -> None:
        """Without a tokenizer no grammar can be compiled: constrained requests are refused."""
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids) if tokenizer is not None else None
        self._waiting: list[_Compiling[R]] = []

    # -- the wait-list -------------------------------------------------------------------------

    def check(self, spec: StructuredOutputsParams | None) -> None:
        """Refuse a constrained request this engine cannot serve (before anything is registered)."""
        if spec is not None and self.compiler is None:
            raise InvalidRequest("structured outputs need the model's tokenizer", param="structured_outputs")

    def add(self, request: R, spec: StructuredOutputsParams) -> None:
        """Start compiling `spec` (checked first); the request waits here until `take_ready`."""
        assert self.compiler is not None, "check() refuses constrained requests without a tokenizer"
        self._waiting.append(_Compiling(request, self.compiler.compile(spec)))

    def take_ready(self) -> tuple[list[R], list[tuple[R, str]], list[tuple[R, InvalidRequest]]]:
        """(the requests whose grammar is compiled, each choice with its matcher; the requests whose
        grammar failed to compile, with the reason; the requests whose spec is too costly to compile,
        with the InvalidRequest saying so). Requests that ended meanwhile are dropped."""
        ready: list[R] = []
        failed: list[tuple[R, str]] = []
        rejected: list[tuple[R, InvalidRequest]] = []
        waiting: list[_Compiling[R]] = []
        for entry in self._waiting:
            request, future = entry.request, entry.grammar
            if all(seq.is_finished for seq in request.seqs):  # aborted while compiling
                continue
            if not future.done():
                waiting.append(entry)
                continue
            error = future.exception()
            if isinstance(error, InvalidRequest):
                rejected.append((request, error))
            elif error is not None:
                failed.append((request, f"structured output: the grammar could not be compiled: {error}"))
            else:
                assert self.compiler is not None
                budget = MatchBudget()  # the request's matching time, all its choices together
                for seq in request.seqs:
                    seq.grammar = self.compiler.matcher(future.result(), budget)
                ready.append(request)
        self._waiting = waiting
        return ready, failed, rejected

    def withdraw(self, request_id: str) -> None:
        """The request ended (aborted, failed): it no longer waits for its compile, which stops when
        no other request waits for the same spec."""
        future = self.compiling(request_id)
        if future is not None:
            future.cancel()

    def compiling(self, request_id: str) -> Future | None:
        """The compile a waiting request waits for (None: it waits for none)."""
        return next((entry.grammar for entry in self._waiting if entry.request.request_id == request_id), None)

    @property
    def num_waiting_seqs(self) -> int:
        return sum(len(entry.request.seqs) for entry in self._waiting)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a waiting request's grammar is compiled, at most `timeout` seconds."""
        if self._waiting:
            wait([entry.grammar for entry in self._waiting], timeout=timeout, return_when=FIRST_COMPLETED)

    def warm(self) -> None:
        """Start the compiler's worker processes now, in the background (see GrammarCompiler.warm)."""
        if self.compiler is not None:
            self.compiler.warm()

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()

    # -- masks and tokens ----------------------------------------------------------------------

    @staticmethod
    def fill_mask(mask: GrammarMask, sampled: Seq[ConstrainedSeq]) -> None:
        """Fill a step's allowed-token bitmask from its rows' matchers (`sampled`: the step's sampling
        sequences, in row order). Only once every step before it has landed: the matchers are then
        current. A row whose sequence ended meanwhile is left unmasked (its token is discarded)."""
        mask.fill([None if sampled[item].is_finished else sampled[item].grammar for item in mask.items])

    @staticmethod
    def accept(seq: ConstrainedSeq, token: int) -> bool:
        """Advance the sequence's matcher past a sampled token; False if the grammar rejects it."""
        return bool(seq.grammar.accept_token(token))

    @staticmethod
    def over_budget(seq: ConstrainedSeq) -> bool:
        """Whether the sequence's request has spent its matching budget (it must be stopped)."""
        return seq.grammar is not None and bool(seq.grammar.over_budget)

    @staticmethod
    def is_complete(seq: ConstrainedSeq) -> bool:
        """Whether the grammar has ended the output (its stop token taken, or nothing may follow)."""
        return bool(seq.grammar.is_terminated())
