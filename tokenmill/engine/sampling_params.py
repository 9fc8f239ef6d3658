"""Per-request sampling settings, validated once when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.errors import InvalidRequest

# Hard limits that keep one request from exhausting the server (see RELIABILITY.md).
MAX_N = 16
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20  # --max-logprobs' default (vLLM's): the engine refuses more (InputProcessor)
MAX_LOGPROBS_CEILING = 1 << 20  # what SamplingParams accepts at all (a vocabulary's worth)


@dataclass
class SamplingParams:
    """How to pick tokens for one request; field names follow vLLM/OpenAI."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # number of top logprobs to return per token
    # Logprobs of the prompt's own tokens (scoring): the number of top alternatives to report with
    # each (0: only the token's own). max_tokens may then be 0: score the prompt, generate nothing.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # False: special tokens the model writes (Mistral's [TOOL_CALLS]) stay in the text; the EOS that
    # ends the sequence never does.
    skip_special_tokens: bool = True
    # The output must match a JSON schema, regex, choice or grammar (a dict is read as vLLM's object).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        try:
            self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except (TypeError, ValueError):
            raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias") from None
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from user input, rejecting unknown fields by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling field(s): {', '.join(unknown)}", param=unknown[0])
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def deterministic(self) -> bool:
        """Same request, same output: greedy, or sampled with a fixed seed."""
        return self.greedy or self.seed is not None

    def validate(self) -> None:
        """Raises InvalidRequest naming the field (`param`) of the first bad value."""

        def number(name: str, value: Any, lo: float, hi: float, param: str | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}", param=param or name)
            if not math.isfinite(value) or not lo <= value <= hi:
                raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}", param=param or name)

        def integer(name: str, value: Any, lo: int, hi: int, param: str | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__}", param=param or name)
            if not lo <= value <= hi:
                raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}", param=param or name)

        integer("max_tokens", self.max_tokens, 0, 1 << 20)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS_CEILING)
        elif self.max_tokens == 0:
            raise InvalidRequest(
                "max_tokens must be at least 1 (0 only scores the prompt: set prompt_logprobs)", param="max_tokens"
            )
        number("temperature", self.temperature, 0.0, 100.0)
        number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
        integer("top_k", self.top_k, -1, 1 << 20)
        number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            integer("seed", self.seed, -(1 << 63), (1 << 64) - 1)
        integer("n", self.n, 1, MAX_N)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", param="stop"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop strings must be non-empty strings", param="stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters", param="stop")
        for t in self.stop_token_ids:
            integer("stop_token_ids entry", t, 0, 1 << 31, param="stop_token_ids")
        number("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed", param="logit_bias")
        for v in self.logit_bias.values():
            number("logit_bias value", v, -100.0, 100.0, param="logit_bias")
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, MAX_LOGPROBS_CEILING)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs must be a StructuredOutputsParams", param="structured_outputs")
