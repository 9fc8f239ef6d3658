"""Tool-call parsers on realistic model outputs (Hermes/Qwen, Llama 3 JSON, Mistral, pythonic,
Qwen3-Coder XML, Phi-4-mini, and the forced formats of tool_choice required / named), whole and
streamed: every way of cutting the text into deltas gives the same calls and content as parsing it
at once, and no call markup leaks into the content."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.utils.tool_models import HERMES_TEMPLATE, LLAMA3_TEMPLATE
from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.server.tools.catalog import PARSERS, default_parser_name
from tokenmill.server.tools.definitions import required_calls_schema
from tokenmill.server.tools.formats import MistralParser, Phi4MiniJsonParser, PythonicParser, Qwen3CoderParser
from tokenmill.server.tools.parsers import (
    ArgumentsOnly,
    HermesParser,
    JsonCallList,
    Llama3JsonParser,
    ParsedCall,
    ParsedText,
    ToolCallParser,
    parse_text,
)

pytestmark = pytest.mark.unit

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = '{"query": "a } b { \\"quoted\\" </tool_call> <tool_call> ; ]", "n": [1, {"x": null}], "ok": true}'


def streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ParsedCall], bool]:
    """Feed `pieces` one by one; the concatenated content, the calls rebuilt from their deltas (each
    call's first delta must name it and carry no arguments, as OpenAI's does) and `failed`."""
    content, calls = "", {}
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            if piece.name is not None:
                assert piece.index not in calls and piece.index == len(calls) and piece.arguments == ""
                calls[piece.index] = ParsedCall(piece.name, "")
            else:
                assert piece.arguments, "an argument delta carries text"
            calls[piece.index].arguments += piece.arguments
    return content, list(calls.values()), parser.failed


def assert_all_splits_agree(new_parser, text: str, expected: ParsedText) -> None:
    """The whole text parses to `expected`; so does the stream, cut at every single position and
    character by character."""
    assert parse_text(new_parser(), text) == expected
    want = (expected.content or "", expected.calls, False)
    for cut in range(len(text) + 1):
        assert streamed(new_parser(), [text[:cut], text[cut:]]) == want, cut
    assert streamed(new_parser(), list(text)) == want


# ---------------------------------------------------------------------------------------------- Hermes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
            ParsedText(None, [ParsedCall("get_weather", WEATHER)]),
            id="one call (Qwen 2.5 layout)",
        ),
        pytest.param(
            f'I will look that up.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
            f'\n<tool_call>\n{{"name": "search", "arguments": {TRICKY}}}\n</tool_call>',
            ParsedText("I will look that up.", [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)]),
            id="text then two calls, markup and braces inside strings",
        ),
        pytest.param(
            '<tool_call>{"name":"f","arguments":{}}</tool_call><tool_call>{"name":"g","arguments":{"a":1}}</tool_call>'
            " Done: see results.",
            ParsedText("Done: see results.", [ParsedCall("f", "{}"), ParsedCall("g", '{"a":1}')]),
            id="compact calls back to back, text after",
        ),
        pytest.param(
            '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>',
            ParsedText(None, [ParsedCall("search", '{"q": "x"}')]),
            id="arguments before the name",
        ),
        pytest.param(
            '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>',
            ParsedText(None, [ParsedCall("search", '{"q": "x"}')]),
            id="arguments as a JSON string",
        ),
        pytest.param(
            '<tool_call>\n{"name": "now"}\n</tool_call>', ParsedText(None, [ParsedCall("now", "{}")]), id="no arguments"
        ),
        pytest.param(
            '<tool_call>\n{"name": "now", "arguments": null}\n</tool_call>',
            ParsedText(None, [ParsedCall("now", "{}")]),
            id="null arguments",
        ),
        pytest.param(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京 🌧"}}',
            ParsedText(None, [ParsedCall("get_weather", '{"city": "Zürich 東京 🌧"}')]),
            id="no closing tag, non-ASCII",
        ),
        pytest.param(
            "The answer is 3 < 4 and <b>bold</b> <tool_ca",
            ParsedText("The answer is 3 < 4 and <b>bold</b> <tool_ca", []),
            id="text with '<' and a partial tag at the end",
        ),
        pytest.param("  Plain answer.  \n", ParsedText("  Plain answer.  \n", []), id="plain text is kept verbatim"),
    ],
)
def test_hermes(text: str, expected: ParsedText) -> None:
    assert_all_splits_agree(HermesParser, text, expected)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # unclosed object
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off (max_tokens)
    ],
)
def test_hermes_malformed_call_after_its_name_is_content_when_parsed_whole(text: str) -> None:
    """A call that breaks after its name was readable: the whole output is content (vLLM's rule)."""
    assert parse_text(HermesParser(), text) == ParsedText(text, [])


@pytest.mark.parametrize(
    "text",
    [
        "Sure <tool_call> is how I call tools. Anyway, hi.",
        '<tool_call>\n[{"name": "get_weather"}]\n</tool_call> then text',
        '<tool_call>\n{"city": "Paris"}\n</tool_call>',  # no name: not a call
        '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
    ],
)
def test_hermes_markup_that_is_no_call_is_content_streamed_or_not(text: str) -> None:
    assert_all_splits_agree(HermesParser, text, ParsedText(text, []))


OFFERED = {"get_weather": {"type": "object"}}


@pytest.mark.parametrize(
    "new_parser",
    [lambda: HermesParser(tools=OFFERED), lambda: Llama3JsonParser(tools=OFFERED)],
    ids=["hermes", "llama3_json"],
)
def test_calls_of_functions_not_offered_are_text(new_parser) -> None:
    """tool_choice auto: a call naming a function the request did not offer is no call (it and what
    follows are content), whatever order its keys come in; an offered one still is."""
    hermes = isinstance(new_parser(), HermesParser)

    def call(name: str, first: str = "name") -> str:
        body = (
            f'{{"name": "{name}", "arguments": {WEATHER}}}'
            if first == "name"
            else f'{{"arguments": {WEATHER}, "name": "{name}"}}'
        )
        return f"<tool_call>\n{body}\n</tool_call>" if hermes else body

    for text in (
        call("delete_files"),
        call("delete_files", first="arguments"),
        call("delete_files") + ";" + call("get_weather"),
    ):
        assert_all_splits_agree(new_parser, text, ParsedText(text, []))
    assert_all_splits_agree(new_parser, call("get_weather"), ParsedText(None, [ParsedCall("get_weather", WEATHER)]))


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert_all_splits_agree(lambda: HermesParser(max_calls=1), text, ParsedText(None, [ParsedCall("a", "{}")]))


def test_hermes_arguments_stream_as_they_are_generated() -> None:
    """Argument text is sent as it arrives, not at the end of the call; partial markup is held back."""
    parser = HermesParser()
    assert parser.feed("Checking.\n<tool_").content == "Checking."
    first = parser.feed('call>\n{"name": "get_weather", "argu')
    assert first.content == "" and [(d.index, d.name, d.arguments) for d in first.calls] == [(0, "get_weather", "")]
    assert [d.arguments for d in parser.feed('ments": {"city": "Pa').calls] == ['{"city": "Pa']
    assert [d.arguments for d in parser.feed('ris"}}\n</tool').calls] == ['ris"}']
    end = parser.feed("_call>")
    assert end.content == "" and end.calls == []


def test_hermes_streamed_with_real_token_boundaries(default_model_dir) -> None:
    """Deltas as the detokenizer produces them for a real BPE vocabulary (pieces straddle the markup)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = (
        f'Let me check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "search", "arguments": {TRICKY}}}\n</tool_call>'
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: k + 1])[len(tokenizer.decode(ids[:k])) :] for k in range(len(ids))]
    assert "".join(pieces) == text
    expected = parse_text(HermesParser(), text)
    assert expected.calls == [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)]
    assert streamed(HermesParser(), pieces) == (expected.content, expected.calls, False)


# ---------------------------------------------------------------------------------------------- Llama 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f'{{"name": "get_weather", "parameters": {WEATHER}}}',
            ParsedText(None, [ParsedCall("get_weather", WEATHER)]),
            id="one call",
        ),
        pytest.param(
            f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "search", "parameters": {TRICKY}}}',  # noqa: E501
            ParsedText(None, [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)]),
            id="python tag, two calls separated by ;",
        ),
        pytest.param(
            '\n{"type": "function", "name": "now", "arguments": {}}',
            ParsedText(None, [ParsedCall("now", "{}")]),
            id="leading newline, extra key, 'arguments'",
        ),
        pytest.param(
            '{"name": "now", "parameters": {}}\n\nI called it.',
            ParsedText("I called it.", [ParsedCall("now", "{}")]),
            id="text after the call",
        ),
        pytest.param(
            "The capital of France is Paris.", ParsedText("The capital of France is Paris.", []), id="plain text"
        ),
        pytest.param(
            ' {"answer": 42, "unit": "km"}',
            ParsedText(' {"answer": 42, "unit": "km"}', []),
            id="JSON that is no call stays content",
        ),
        pytest.param(
            'Here: {"name": "now", "parameters": {}}',
            ParsedText('Here: {"name": "now", "parameters": {}}', []),
            id="a call must open the output",
        ),
    ],
)
def test_llama3_json(text: str, expected: ParsedText) -> None:
    assert_all_splits_agree(Llama3JsonParser, text, expected)


def test_llama3_malformed_call_is_content_when_parsed_whole() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"'
    assert parse_text(Llama3JsonParser(), text) == ParsedText(text, [])


# ---------------------------------------------------------------------------------------------- Mistral


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
            f'{{"name": "search", "arguments": {TRICKY}}}]',
            ParsedText(None, [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)]),
            id="v3: a JSON list after [TOOL_CALLS]",
        ),
        pytest.param(
            f'Checking. [TOOL_CALLS] {{"name": "get_weather", "arguments": {WEATHER}}}',
            ParsedText("Checking.", [ParsedCall("get_weather", WEATHER)]),
            id="text, then one call object",
        ),
        pytest.param(
            f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]search[ARGS]{TRICKY}",
            ParsedText(None, [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)]),
            id="v11: name[ARGS]{...} per call",
        ),
        pytest.param(
            f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{WEATHER}",
            ParsedText(None, [ParsedCall("get_weather", WEATHER)]),
            id="v13: with a call id",
        ),
        pytest.param(
            "Use [TOOL_CALLS] to call: [TOOL_CALLS]",
            ParsedText("Use [TOOL_CALLS] to call: [TOOL_CALLS]", []),
            id="the marker in prose",
        ),
        pytest.param(
            "[TOOL_CALLS][1, 2] and [ARGS]", ParsedText("[TOOL_CALLS][1, 2] and [ARGS]", []), id="a list of no calls"
        ),
    ],
)
def test_mistral(text: str, expected: ParsedText) -> None:
    assert_all_splits_agree(MistralParser, text, expected)


# ---------------------------------------------------------------------------------------------- pythonic


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            '[get_weather(city="Paris", unit="celsius"), search(query=\'a "b" ) ] c\', n=[1, {"x": None}], ok=true)]',
            ParsedText(
                None,
                [
                    ParsedCall("get_weather", WEATHER),
                    ParsedCall("search", '{"query": "a \\"b\\" ) ] c", "n": [1, {"x": null}], "ok": true}'),
                ],
            ),
            id="two calls, brackets and quotes inside strings, JSON and Python literals",
        ),
        pytest.param(
            "<|python_start|>[now()]<|python_end|>",
            ParsedText("<|python_end|>", [ParsedCall("now", "{}")]),
            id="Llama 4 markers kept as text",
        ),
        pytest.param(
            ' [get_weather(city="Zürich 東京")]\nDone.',
            ParsedText("Done.", [ParsedCall("get_weather", '{"city": "Zürich 東京"}')]),
            id="leading space, non-ASCII, text after the list",
        ),
        pytest.param("[f(x) for x in items]", ParsedText("[f(x) for x in items]", []), id="a comprehension"),
        pytest.param("[docs](https://example.com)", ParsedText("[docs](https://example.com)", []), id="a link"),
        pytest.param("[f(1, 2)]", ParsedText("[f(1, 2)]", []), id="positional arguments"),
        pytest.param("[f(a=g(b=1))]", ParsedText("[f(a=g(b=1))]", []), id="a call as a value"),
        pytest.param("[1, 2, 3] are numbers", ParsedText("[1, 2, 3] are numbers", []), id="a list of numbers"),
        pytest.param("Call [now()] later", ParsedText("Call [now()] later", []), id="a call list must open the output"),
    ],
)
def test_pythonic(text: str, expected: ParsedText) -> None:
    assert_all_splits_agree(PythonicParser, text, expected)


# ---------------------------------------------------------------------------------------------- Qwen3-Coder

XML_TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "ratio": {"type": ["number", "null"]},
            "hot": {"type": "boolean"},
            "filters": {"type": "object"},
            "tags": {"anyOf": [{"type": "array"}, {"type": "null"}]},
        },
    },
    "now": {"type": "object"},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=hot>\nTrue\n"
            "</parameter>\n<parameter=filters>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n['x']\n"
            "</parameter>\n</function>\n</tool_call>",
            ParsedText(
                "Let me check.",
                [
                    ParsedCall(
                        "get_weather",
                        '{"city": "New York", "days": 3, "ratio": 0.5, "hot": true, "filters": {"a": [1, 2]}, '
                        '"tags": ["x"]}',
                    )
                ],
            ),
            id="values typed by the schema",
        ),
        pytest.param(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n  <b>x</b> = 1 \n</parameter>\n<parameter=days>"
            "\nmany\n</parameter>\n<parameter=extra>\n5\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=now>\n</function>\n</tool_call>",
            ParsedText(
                None,
                [
                    ParsedCall("get_weather", '{"city": "  <b>x</b> = 1 ", "days": "many", "extra": "5"}'),
                    ParsedCall("now", "{}"),
                ],
            ),
            id="markup in a string, an unreadable integer, an unknown key, no parameters",
        ),
        pytest.param(
            "<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</function>",
            ParsedText(None, [ParsedCall("get_weather", '{"city": "Paris", "days": 2}')]),
            id="no <tool_call>, no </parameter>",
        ),
        pytest.param(
            "The <tool_call> tag wraps calls.",
            ParsedText("The <tool_call> tag wraps calls.", []),
            id="the tag in prose",
        ),
        pytest.param(
            "Write <function=f> here", ParsedText("Write <function=f> here", []), id="a function tag in prose"
        ),
    ],
)
def test_qwen3_coder(text: str, expected: ParsedText) -> None:
    assert_all_splits_agree(lambda: Qwen3CoderParser(tools=XML_TOOLS), text, expected)


# ---------------------------------------------------------------------------------------------- Phi-4-mini


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f'functools[{{"name": "get_weather", "arguments": {WEATHER}}}, '
            f'{{"name": "search", "arguments": {TRICKY}}}]',
            ParsedText(None, [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)]),
            id="two calls",
        ),
        pytest.param(
            'Sure. functools[{"name": "now", "arguments": {}}]',
            ParsedText("Sure.", [ParsedCall("now", "{}")]),
            id="text before",
        ),
        pytest.param(
            "Use functools[partial] for that.", ParsedText("Use functools[partial] for that.", []), id="Python prose"
        ),
    ],
)
def test_phi4_mini_json(text: str, expected: ParsedText) -> None:
    assert_all_splits_agree(Phi4MiniJsonParser, text, expected)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
        (PythonicParser, '[get_weather(city="Paris"), now('),
        (Qwen3CoderParser, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
        (Phi4MiniJsonParser, 'functools[{"name": "get_weather", "arguments": {"city": 1'),
    ],
)
def test_a_call_cut_off_after_its_name_is_content_when_parsed_whole(parser, text: str) -> None:
    assert parse_text(parser(), text) == ParsedText(text, [])


def test_parallel_tool_calls_false_keeps_the_first_call_in_every_format() -> None:
    for parser, text in (
        (MistralParser, "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}"),
        (PythonicParser, "[a(), b()]"),
        (
            Qwen3CoderParser,
            "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>",
        ),
        (Phi4MiniJsonParser, 'functools[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'),
    ):
        assert_all_splits_agree(lambda p=parser: p(max_calls=1), text, ParsedText(None, [ParsedCall("a", "{}")]))


# ---------------------------------------------------------------------------------------------- forced formats


def test_required_list_and_named_arguments() -> None:
    text = f' [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "search", "arguments": {TRICKY}}}] '
    assert_all_splits_agree(
        JsonCallList, text, ParsedText(None, [ParsedCall("get_weather", WEATHER), ParsedCall("search", TRICKY)])
    )
    assert_all_splits_agree(
        lambda: ArgumentsOnly("search"), f"\n{TRICKY}\n", ParsedText(None, [ParsedCall("search", TRICKY)])
    )
    # Named: the name is sent before any argument text arrives.
    assert [d.name for d in ArgumentsOnly("search").feed("").calls] == ["search"]
    for broken in ('[{"name": "a", "arguments": {}}', "[]", '{"name": "a"}'):
        assert parse_text(JsonCallList(), broken) == ParsedText(broken, [])
    assert parse_text(ArgumentsOnly("a"), '{"x": ') == ParsedText('{"x": ', [])


def test_required_schema_accepts_calls_and_keeps_refs_resolvable() -> None:
    """The schema for tool_choice "required": anyOf the functions, each function's parameters under
    its own $defs entry with its root-relative refs ($defs, `#`, `#/properties/...`) rewritten, so a
    valid call validates and a wrong one does not."""
    import jsonschema

    item = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
    params_a = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
        "required": ["items"],
        "$defs": {"Item": item},
    }
    params_b = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    params_tree = {  # refs to the parameters' own root and to one of its properties
        "type": "object",
        "properties": {"v": {"type": "integer"}, "w": {"$ref": "#/properties/v"}, "child": {"$ref": "#"}},
        "required": ["v", "w"],
    }
    schema = required_calls_schema(
        [("a", params_a), ("b", params_b), ("c", None), ("tree", params_tree)], parallel=True
    )
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [
        {"name": "a", "arguments": {"items": [{"v": 1}]}},
        {"name": "b", "arguments": {"q": "x"}},
        {"name": "c", "arguments": {}},
        {"name": "tree", "arguments": {"v": 1, "w": 2, "child": {"v": 3, "w": 4}}},
    ]
    jsonschema.validate(ok, schema)
    StructuredOutputsParams(json=schema).validate()  # and xgrammar resolves them too
    for bad in (
        [],
        [{"name": "a", "arguments": {"items": [{"v": "1"}]}}],
        [{"name": "d", "arguments": {}}],
        [{"name": "b", "arguments": {}}],
        [{"name": "tree", "arguments": {"v": 1, "w": "2"}}],
        [{"name": "tree", "arguments": {"v": 1, "w": 2, "child": {"v": 3}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_calls_schema([("b", params_b)], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([ok[1], ok[1]], single)


# ---------------------------------------------------------------------------------------------- properties

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_arguments = st.dictionaries(st.text(max_size=6), _json_values, max_size=4)
_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,20}", fullmatch=True)
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20).filter(
    lambda t: "<tool_call>" not in t
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=_text,
    calls=st.lists(st.tuples(_names, _arguments, st.booleans()), min_size=1, max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
def test_hermes_any_arguments_any_cuts(before, calls, indent, cuts) -> None:
    """Whatever the arguments (any JSON, escapes, unicode) and however the text is cut into deltas,
    the calls come back with exactly those arguments, streamed or whole."""
    body = "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, indent=indent, ensure_ascii=ascii_)}\n</tool_call>"
        for n, a, ascii_ in calls
    )
    text = before + body
    whole = parse_text(HermesParser(), text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [(n, a) for n, a, _ in calls]
    assert whole.content == (before.rstrip() or None)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert streamed(HermesParser(), pieces) == (whole.content or "", whole.calls, False)


# ---------------------------------------------------------------------------------------------- registry


def test_default_parser_from_the_chat_template() -> None:
    assert default_parser_name(HERMES_TEMPLATE) == "hermes"
    assert default_parser_name(LLAMA3_TEMPLATE) == "llama3_json"
    smollm2 = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}{% endfor %}"
    )
    assert default_parser_name(smollm2) is None and default_parser_name(None) is None
    qwen3_coder = "{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' + key + '>' }}"
    assert default_parser_name(qwen3_coder) == "qwen3_coder"
    assert default_parser_name("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert default_parser_name("{{ '<|header_start|>' }}<|python_start|>") == "pythonic"
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "phi4_mini_json"}


def test_markers_the_detokenizer_drops_are_reported(default_model_dir, caplog) -> None:
    """A tokenizer where <tool_call> is a special token: outputs leave it out, so the startup log
    says auto calls cannot be read; where it is text (SmolLM2's BPE, Qwen's added tokens), no warning."""
    from transformers import AutoTokenizer

    from tokenmill.server.tools.plan import resolve_auto_parser

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    with caplog.at_level("WARNING", logger="tokenmill.server.tools.plan"):
        assert resolve_auto_parser("hermes", tokenizer) is HermesParser
    assert not caplog.records
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    with caplog.at_level("WARNING", logger="tokenmill.server.tools.plan"):
        assert resolve_auto_parser("auto", tokenizer) is None  # SmolLM2's template offers no tools
        assert resolve_auto_parser("hermes", tokenizer) is HermesParser
    (warning,) = caplog.records
    assert "<tool_call>, </tool_call>" in warning.getMessage() and "cannot read calls" in warning.getMessage()


def test_auto_parsers_get_the_requests_tool_schemas() -> None:
    """tool_choice auto: the parser knows the request's functions (qwen3_coder types values by them),
    and a parser whose markers are special tokens asks for them in the output text."""
    from tokenmill.server.protocol import ChatCompletionRequest
    from tokenmill.server.tools.plan import plan_tools

    function = {"name": "get_weather", "parameters": XML_TOOLS["get_weather"]}
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": function}]}
    )
    plan = plan_tools(req, Qwen3CoderParser)
    text = "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>"
    assert parse_text(plan.new_parser(), text).calls == [ParsedCall("get_weather", '{"days": 3}')]
    assert plan.new_parser().names == {"get_weather"}  # a call to another function stays text
    assert plan_tools(req, MistralParser).keeps_special_tokens and not plan.keeps_special_tokens
