"""Every tool-call format by its `--tool-call-parser` name, and the one a chat template asks for."""

from __future__ import annotations

from tokenmill.server.tools.formats import MistralParser, Phi4MiniJsonParser, PythonicParser, Qwen3CoderParser
from tokenmill.server.tools.parsers import HermesParser, Llama3JsonParser, ToolCallParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
    "phi4_mini_json": Phi4MiniJsonParser,
}


def default_parser_name(chat_template: str | None) -> str | None:
    """The parser a chat template asks for: Qwen3-Coder's XML when it writes <function=...> and
    <parameter=...>; Mistral's when it writes [TOOL_CALLS]; pythonic for Llama 4's <|python_start|>;
    Hermes when it writes <tool_call> (Qwen 2.5/3, Hermes); Llama 3 JSON when it is a Llama 3
    template that offers tools (<|python_tag|> or the JSON instructions next to
    <|start_header_id|>); else none."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_start|>" in template:
        return "pythonic"
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or "tools" in template):
        return "llama3_json"
    return None
