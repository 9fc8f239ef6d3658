"""Request fields shared by completions and chat completions: sampling, logprobs, structured outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
)

from tokenmill.engine.sampling_params import MAX_N, SamplingParams
from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import bad_request, from_invalid_request
from tokenmill.server.protocol.base import LenientModel, NullMeansDefault, StreamOptions, TokenIdKey, ignored


class JsonSchemaFormat(LenientModel):
    """`response_format.json_schema`: the output is JSON matching `schema`."""

    name: str | None = None  # OpenAI requires it; it names the schema and changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # true: a schema keyword the grammar cannot enforce is a 400 naming it; otherwise such keywords
    # are relaxed (see tokenmill.engine.structured_output.params). Either way no properties beyond
    # the schema's are written (xgrammar's strict mode).
    strict: bool | None = None


class ResponseFormat(LenientModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Where each way of asking for structured output puts its spec, in the engine's StructuredOutputsParams.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class SamplingRequest(NullMeansDefault):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    model: str | None = None  # optional: a single-model server knows what to serve
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[TokenIdKey, float] | None = None  # OpenAI sends token ids as JSON object keys
    # Extras beyond the OpenAI API (same names as vLLM so existing clients' extra_body works).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # with --scheduling-policy priority: lower values are scheduled first
    # vLLM's scoring extra: the prompt tokens' logprobs with this many top alternatives each (not with stream).
    prompt_logprobs: int | None = Field(None, ge=0)
    # Accepted, no effect here.
    user: str | None = ignored("end-user ids are only logged with --log-prompts")
    store: bool | None = ignored()
    metadata: dict[str, str] | None = ignored()
    service_tier: str | None = ignored()
    # Structured output, in OpenAI's spelling and vLLM's (at most one per request).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"json"|"regex"|"choice"|"grammar"|"json_object": ...}
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = ignored("xgrammar is the only backend")
    guided_whitespace_pattern: str | None = ignored("JSON whitespace is bounded by the engine")

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def usage_on_every_chunk(self) -> bool:
        """vLLM's continuous_usage_stats (with include_usage, as vLLM reads it)."""
        return self.include_usage_in_stream and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def structured_output(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's structured-output constraint and the field it came from (None: free text)."""
        # (the values, the field they came from, strict: vLLM's extras always are)
        specs: list[tuple[dict[str, Any], str, bool]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(({"json_object": True}, "response_format", True))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request(
                    "response_format json_schema needs json_schema.schema", param="response_format.json_schema.schema"
                )
            strict = fmt.json_schema.strict is True
            specs.append(({"json": fmt.json_schema.schema_}, "response_format.json_schema.schema", strict))
        if self.structured_outputs is not None:
            specs.append((self.structured_outputs, "structured_outputs", True))
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                specs.append(({kind: getattr(self, name)}, name, True))
        if not specs:
            return None
        if len(specs) > 1:
            raise bad_request(
                f"set only one of {', '.join(source for _, source, _ in specs)}: each constrains the whole output",
                param=specs[1][1],
            )
        values, source, strict = specs[0]
        try:
            return StructuredOutputsParams.from_dict(values, strict), source
        except InvalidRequest as exc:
            raise from_invalid_request(exc, self.api_param(exc.param, source)) from None

    def api_param(self, param: str | None, source: str | None = None) -> str | None:
        """The request field an engine error's `param` is about (structured output: where it was set)."""
        if source is None:
            found = self.structured_output() if param and param.startswith("structured_outputs") else None
            source = found[1] if found else None
        if source is None or source == "structured_outputs" or not param:
            return param
        return source

    def check_prompt_logprobs(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> SamplingParams:
        """Translate to engine params; SamplingParams' own validation errors become 400s. `defaults`:
        the model's sampling settings (--generation-config) for the fields the request leaves unset."""
        values: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            n=self.n,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )
        for name, value in (defaults or {}).items():
            if name in values and name != "max_tokens" and name not in self.model_fields_set:
                values[name] = value
        constraint = self.structured_output()
        if constraint is not None:
            values["structured_outputs"] = constraint[0]
        try:
            return SamplingParams.from_dict(values)
        except InvalidRequest as exc:
            raise from_invalid_request(exc) from None
