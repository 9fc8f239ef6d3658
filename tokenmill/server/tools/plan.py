"""One chat request's tools -> how its output is constrained and read back as tool calls.

tool_choice, as OpenAI defines it and vLLM implements it:
* "none": the tools are still rendered into the prompt (the model may know them), the output is text;
* "auto" (the default with tools): the model chooses; its text is read by the server's tool-call
  parser (`--tool-call-parser`); without one, the output stays text;
* "required" / a named function: the output is held to a JSON schema built from the tools (see
  `definitions`), then read as calls whatever the model's own format is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.structured_output.params import ReasoningSection, StructuredOutputsParams, unenforceable
from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import ChatCompletionRequest, NamedToolChoice
from tokenmill.server.tools.catalog import PARSERS, default_parser_name
from tokenmill.server.tools.definitions import arguments_schema, required_calls_schema
from tokenmill.server.tools.parsers import ArgumentsOnly, JsonCallList, ToolCallParser

logger = logging.getLogger(__name__)

AUTO = "auto"
NONE = "none"


@dataclass(frozen=True)
class ToolPlan:
    """`new_parser` makes one parser per choice; `output_schema` is the JSON schema the output must
    follow (None: unconstrained); `keeps_special_tokens`: the parser reads markers that are special
    tokens (the output is detokenized with them)."""

    new_parser: Callable[[], ToolCallParser]
    output_schema: dict[str, Any] | None = None
    keeps_special_tokens: bool = False


def plan_tools(req: ChatCompletionRequest, auto_parser: type[ToolCallParser] | None) -> ToolPlan | None:
    """Check tools against tool_choice (400s naming the field); None when the output is plain text."""
    choice = req.tool_choice
    tools = req.tools or []
    if not tools:
        if choice is None or choice in (NONE, AUTO):  # clients send these without tools
            return None
        raise bad_request("tool_choice needs tools: the request has none", param="tool_choice")
    by_name = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in by_name:
            raise bad_request(f"Duplicate function name {name!r} in tools", param=f"tools[{i}].function.name")
        by_name[name] = tool.function
    max_calls = None if req.parallel_tool_calls else 1
    if choice == NONE:
        return None
    if choice is None or choice == AUTO:
        if auto_parser is None:
            return None
        schemas = {name: function.parameters for name, function in by_name.items()}
        return ToolPlan(
            lambda: auto_parser(max_calls=max_calls, tools=schemas),
            keeps_special_tokens=auto_parser.KEEPS_SPECIAL_TOKENS,
        )
    if isinstance(choice, NamedToolChoice):
        function = by_name.get(choice.function.name)
        if function is None:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not in tools",
                param="tool_choice.function.name",
            )
        return ToolPlan(lambda: ArgumentsOnly(function.name), arguments_schema(function.parameters))
    schema = required_calls_schema([(f.name, f.parameters) for f in by_name.values()], parallel=max_calls is None)
    return ToolPlan(lambda: JsonCallList(max_calls=max_calls), schema)


def constrained(
    plan: ToolPlan, req: ChatCompletionRequest, params: SamplingParams, reasoning: ReasoningSection | None = None
) -> SamplingParams:
    """`params` holding the output to the plan's JSON schema (tool_choice required / named), after
    the `reasoning` section when there is one. The schema is parsed here (off the event loop: call
    in a thread) so that one xgrammar cannot enforce is a 400 naming the tool whose parameters it is."""
    assert plan.output_schema is not None
    if params.structured_outputs is not None:
        source = req.structured_output()[1]  # type: ignore[index]
        raise bad_request(
            f"{source} cannot be combined with tool_choice {choice_label(req)}, which sets the output format itself",
            param=source,
        )
    # A function with strict: true must be enforceable as it is; the others' unenforceable keywords
    # are relaxed.
    for i, tool in enumerate(req.tools or []):
        if tool.function.strict:
            problem = unenforceable(arguments_schema(tool.function.parameters), strict=True)
            if problem:
                raise bad_request(
                    f"The tool's parameters cannot be enforced (strict: true): {problem}",
                    param=f"tools[{i}].function.parameters",
                    code="unsupported_schema",
                )
    # json.dumps' layout (one space after "," and ":", no other whitespace): the arguments read as
    # models write them, and no tokens go to whitespace.
    try:
        constraint = StructuredOutputsParams(
            json=plan.output_schema, disable_any_whitespace=True, strict=False, reasoning=reasoning
        )
        constraint.validate()
    except InvalidRequest as exc:
        raise bad_request(f"The tools cannot be enforced: {exc.message}", param=_unenforceable_tool(req)) from None
    return dataclasses.replace(params, structured_outputs=constraint)


def _unenforceable_tool(req: ChatCompletionRequest) -> str:
    """The first tool whose parameters alone xgrammar rejects (else the list as a whole)."""
    for i, tool in enumerate(req.tools or []):
        try:
            StructuredOutputsParams(
                json=arguments_schema(tool.function.parameters), disable_any_whitespace=True, strict=False
            ).validate()
        except InvalidRequest:
            return f"tools[{i}].function.parameters"
    return "tools"


def choice_label(req: ChatCompletionRequest) -> str:
    return repr(req.tool_choice) if isinstance(req.tool_choice, str) else "naming a function"


def resolve_auto_parser(name: str, tokenizer: Any) -> type[ToolCallParser] | None:
    """The parser for tool_choice "auto": `--tool-call-parser` NAME, "none", or "auto" (from the chat
    template). Logged once at startup, so an operator sees why auto calls stay text."""
    parser = _pick(name, getattr(tokenizer, "chat_template", None))
    markers = parser.MARKERS if parser is not None and not parser.KEEPS_SPECIAL_TOKENS else ()
    dropped = [m for m in markers if not _survives_decoding(tokenizer, m)]
    if dropped:
        logger.warning(
            "the tool-call markers %s are special tokens of this tokenizer, which outputs leave out: "
            'tool_choice "auto" cannot read calls from this model',
            ", ".join(dropped),
        )
    return parser


def _survives_decoding(tokenizer: Any, text: str) -> bool:
    """Whether `text` generated by the model appears in the output text (special tokens do not)."""
    if tokenizer is None:
        return False
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True) == text


def _pick(name: str, chat_template: str | None) -> type[ToolCallParser] | None:
    if name == AUTO:
        picked = default_parser_name(chat_template)
        if picked is None:
            logger.info(
                'no tool-call parser for this chat template: tool_choice "auto" answers in plain text '
                "(set --tool-call-parser to read calls)"
            )
            return None
        logger.info("tool-call parser picked from the chat template", extra={"tool_call_parser": picked})
        return PARSERS[picked]
    if name == NONE:
        logger.info('tool-call parsing is off (--tool-call-parser none): tool_choice "auto" answers in plain text')
        return None
    logger.info("tool-call parser", extra={"tool_call_parser": name})
    return PARSERS[name]
