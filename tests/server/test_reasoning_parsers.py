"""Reasoning parsers (deepseek_r1, qwen3) on thinking models' outputs, whole and streamed: where the
output starts (read from the prompt), every way of cutting the text gives the same reasoning and
answer, tool calls are read after the reasoning section, and a structured-output grammar lets the
section come first."""

from __future__ import annotations

import pytest

from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.server.output import OutputReader, ParsedOutput
from tokenmill.server.reasoning import ReasoningPlan
from tokenmill.server.tools.parsers import HermesParser, ParsedCall

pytestmark = pytest.mark.unit

OPEN = "<|im_start|>assistant\n"  # a prompt that leaves the section to the output
OPENED = "<｜Assistant｜><think>\n"  # DeepSeek-R1's: the output starts inside the section
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking false


def _split(plan: ReasoningPlan, pieces: list[str]) -> tuple[str, str]:
    parser = plan.new_parser()
    reasoning = content = ""
    for split in [parser.feed(p) for p in pieces] + [parser.finish()]:
        reasoning += split.reasoning
        content += split.content
    return reasoning, content


@pytest.mark.parametrize(
    ("name", "prompt", "text", "reasoning", "content"),
    [
        ("qwen3", OPEN, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
        ("qwen3", OPEN, "Paris is the capital.", "", "Paris is the capital."),
        ("qwen3", OPEN, "  <think>cut off by max_tok", "cut off by max_tok", ""),
        ("qwen3", OPENED, "Hmm, 2 < 3 </thin but </think>ok", "Hmm, 2 < 3 </thin but ", "ok"),
        ("qwen3", CLOSED, "Paris. <think>not a section</think>", "", "Paris. <think>not a section</think>"),
        ("deepseek_r1", OPENED, "Let me see.</think>\n\nParis.", "Let me see.", "Paris."),
        ("deepseek_r1", OPEN, "No tag, still thinking", "No tag, still thinking", ""),
        ("deepseek_r1", OPEN, "<think>x</think>y", "x", "y"),
        ("deepseek_r1", CLOSED, "Paris.", "", "Paris."),
    ],
)
def test_reasoning_split_streamed_or_whole(name: str, prompt: str, text: str, reasoning: str, content: str) -> None:
    plan = ReasoningPlan.for_prompt(name, prompt)
    assert _split(plan, [text]) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _split(plan, [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert _split(plan, list(text)) == (reasoning, content)


def test_prompt_decides_where_the_output_starts_and_what_a_grammar_allows() -> None:
    assert ReasoningPlan.for_prompt("qwen3", CLOSED).section() is None  # nothing to think: the answer is constrained
    assert ReasoningPlan.for_prompt("qwen3", OPENED).section().start is None  # (the output is inside the section)
    assert ReasoningPlan.for_prompt("qwen3", OPEN).section().start == "<think>"  # an optional section
    assert ReasoningPlan.for_prompt("deepseek_r1", OPEN).section().start is None  # R1 always thinks


def test_tool_calls_are_read_after_the_reasoning() -> None:
    """A <tool_call> inside the reasoning is thought, not a call; the answer's calls are calls."""
    plan = ReasoningPlan.for_prompt("qwen3", OPEN)
    text = (
        '<think>\nMaybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?\n</think>\n\n'
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    whole = OutputReader(plan.new_parser(), HermesParser()).whole(text)
    assert whole == ParsedOutput(
        '\nMaybe <tool_call>{"name": "x", "arguments": {}}</tool_call>?\n',
        "Checking.",
        [ParsedCall("get_weather", '{"city": "Paris"}')],
    )
    for cut in range(len(text) + 1):
        reader = OutputReader(plan.new_parser(), HermesParser())
        pieces = [reader.step(text[:cut], False), reader.step(text[cut:], True)]
        assert "".join(p.reasoning for p in pieces) == whole.reasoning
        assert "".join(p.content for p in pieces) == whole.content
        assert [c.name for p in pieces for c in p.calls if c.name] == ["get_weather"]
    only_thought = OutputReader(plan.new_parser(), None).whole("<think>cut")
    assert only_thought == ParsedOutput("cut", None, [])


@pytest.mark.parametrize("start", [None, "<think>"])
def test_grammar_lets_the_reasoning_section_come_first(default_model_dir, start) -> None:
    """The constrained answer follows the section: `{"a": 1}` after reasoning text and </think> is
    accepted; with an optional section the answer alone is too; reasoning after the answer is not."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tokenmill.engine.structured_output.params import ReasoningSection

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        reasoning=ReasoningSection(end="</think>", start=start),
    )
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_grammar(spec.validate())

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return all(matcher.accept_token(t) for t in ids)

    opening = start or ""
    assert accepts(f'{opening}I think {{"a": 1}} < 2 </thin...</think>\n\n{{"a": 1}}')
    assert accepts('{"a": 1}') == (start is not None)
    assert not accepts(f'{opening}ok</think>{{"a": 1}} more')
    assert spec.key != StructuredOutputsParams(json=spec.json).key  # compiled separately
