"""Structured outputs in the engine: every sampled output matches its JSON schema, regex, choice or
grammar, on the tiny random-weight model (without the mask its output is garbage: see the control
test), with n>1, stop strings, seeds, preemption, overlap scheduling and a padded vocabulary; a slow
compile never stalls other requests; a bad spec is an InvalidRequest naming the field."""

from __future__ import annotations

import json
import re
import time

import jiter
import jsonschema
import psutil
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.errors import InvalidRequest

# Every string, number and list is bounded, so a random model must finish well inside max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
MAX_TOKENS = 256  # outputs of PERSON measured 51-101 tokens (whitespace between elements is bounded)
SAMPLED = dict(temperature=1.0, max_tokens=MAX_TOKENS)

# 480 properties of 5-way unions: ~1 s to compile here (xgrammar releases the GIL meanwhile).
SLOW_SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i}": {
            "type": "object",
            "properties": {f"k{j}": {"type": ["string", "integer", "number", "boolean", "null"]} for j in range(8)},
        }
        for i in range(60)
    },
}


def constrained(**spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), progress=False, kv_cache_memory="64MiB")


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def assert_valid_person(outs) -> None:
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.slow
def test_json_schema_outputs_validate_for_sampled_requests(llm) -> None:
    outs = llm.generate(["Hello"] * 20, SamplingParams(**SAMPLED, structured_outputs=constrained(json=PERSON)))
    assert_valid_person(outs)
    assert len(set(texts(outs))) >= 10  # really sampled: 20 different walks through the grammar


def test_without_a_constraint_the_random_model_writes_no_json(llm) -> None:
    """The control: the same model and sampling unconstrained mostly writes no JSON, so the tests above
    can fail (a short random text, such as digits, may happen to be a JSON prefix)."""
    outs = llm.generate(["Hello"] * 8, SamplingParams(temperature=1.0, max_tokens=24))
    not_json = 0
    for text in texts(outs):
        try:
            jiter.from_json(text.encode(), partial_mode="trailing-strings")
        except ValueError:
            not_json += 1
    assert not_json >= 6, texts(outs)


def test_compact_json_has_no_free_whitespace(llm) -> None:
    outs = llm.generate(
        ["Hi"] * 3, SamplingParams(**SAMPLED, structured_outputs=constrained(json=PERSON, disable_any_whitespace=True))
    )
    assert_valid_person(outs)
    for text in texts(outs):
        assert text == json.dumps(json.loads(text), ensure_ascii=False)  # (", ", ": ") separators, nothing else


def test_json_object_is_an_object_or_a_valid_prefix_of_one(llm) -> None:
    """Any JSON object: unbounded strings, so a random model may not finish; each output is either a
    complete object (finish "stop") or a strict prefix of one (jiter's partial mode rejects any
    malformed JSON)."""
    outs = llm.generate(
        ["Hi"] * 4, SamplingParams(temperature=1.0, max_tokens=32, structured_outputs=constrained(json_object=True))
    )
    for o in outs:
        c = o.outputs[0]
        assert c.text.startswith("{"), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert isinstance(jiter.from_json(c.text.encode(), partial_mode="trailing-strings"), dict), c.text


def test_regex_choice_and_grammar(llm) -> None:
    regex = r"[a-z]{2,5}-[0-9]{1,3}"
    choices = ["red", "green", "blue", "dark violet"]
    # Sums of 1-3 numbers below 100 (the grammar's own bound keeps the random model short).
    grammar = 'root ::= num (" + " num)? (" + " num)?\nnum ::= [1-9] [0-9]?'
    params = (
        [SamplingParams(**SAMPLED, structured_outputs=constrained(regex=regex))] * 8
        + [SamplingParams(**SAMPLED, structured_outputs=constrained(choice=choices))] * 12
        + [SamplingParams(**SAMPLED, structured_outputs=constrained(grammar=grammar))] * 8
    )
    outs = llm.generate(["Pick one:"] * len(params), params)
    got = texts(outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert all(re.fullmatch(regex, t) for t in got[:8]), got[:8]
    assert all(t in choices for t in got[8:20]) and len(set(got[8:20])) > 1, got[8:20]
    assert all(re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,2}", t) for t in got[20:]), got[20:]


def test_n_choices_each_follow_the_schema(llm) -> None:
    (out,) = llm.generate(["Hello"], SamplingParams(**SAMPLED, n=4, structured_outputs=constrained(json=PERSON)))
    assert len(out.outputs) == 4
    assert_valid_person([out])
    assert len({c.text for c in out.outputs}) > 1  # one matcher per choice, each its own walk


def test_stop_strings_cut_constrained_output(llm) -> None:
    regex = r"(ab|cd){6}"
    outs = llm.generate(["x"] * 6, SamplingParams(**SAMPLED, stop=["d"], structured_outputs=constrained(regex=regex)))
    for o in outs:
        c = o.outputs[0]
        assert re.fullmatch(r"(ab)*c?", c.text), c.text  # everything up to the first "d"
        assert (c.finish_reason, c.stop_reason) == ("stop", "d") or c.text == "ab" * 6


def test_seeded_constrained_sampling_repeats(llm) -> None:
    regex = constrained(regex=r"[a-z]{6}-[0-9]{4}")
    params = SamplingParams(**SAMPLED, seed=7, structured_outputs=regex)
    first, second = llm.generate(["Hello"] * 2, params), llm.generate(["Hello"], params)
    assert texts(first)[0] == texts(first)[1] == texts(second)[0]
    other = llm.generate(["Hello"], SamplingParams(**SAMPLED, seed=8, structured_outputs=regex))
    assert texts(other) != texts(second)


def test_mixed_batch_leaves_unconstrained_rows_alone(llm) -> None:
    """Constrained and free rows in one batch: greedy free rows give the same tokens as alone."""
    alone = llm.generate(["The cat"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] + [
        SamplingParams(**SAMPLED, structured_outputs=constrained(json=PERSON))
    ] * 2
    outs = llm.generate(["The cat"] * 3, params)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_valid_person(outs[1:])


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm) -> None:
    outs = llm.generate(
        ["x"] * 4, SamplingParams(**SAMPLED, ignore_eos=True, structured_outputs=constrained(choice=["yes", "no"]))
    )
    for o in outs:
        assert o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop"


def test_logprobs_are_those_of_the_raw_distribution(llm) -> None:
    """As in vLLM: the grammar decides which token is picked; logprobs report the model's own view."""
    (out,) = llm.generate(
        ["x"],
        SamplingParams(temperature=0, max_tokens=4, logprobs=5, structured_outputs=constrained(choice=["yes", "no"])),
    )
    (free,) = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    chosen, top = out.outputs[0].logprobs[0]
    assert top == free.outputs[0].logprobs[0][1]  # the first step's alternatives: the unconstrained ones
    assert chosen <= max(top.values()) and out.outputs[0].text in ("yes", "no")


def test_invalid_specs_are_invalid_requests_naming_the_field(llm) -> None:
    bad = [
        (dict(json={"type": "foo"}), "structured_outputs.json", "Unsupported type"),
        (dict(json="{not json"), "structured_outputs.json", "JSON"),
        (dict(regex="(("), "structured_outputs.regex", "parenthesis"),
        (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
        # Anchors xgrammar would drop (mid-pattern ^ and $) or misread (\A and \Z as letters).
        (dict(regex="a$b"), "structured_outputs.regex", "the anchor $ is not supported there"),
        (dict(regex="(a|^b)c"), "structured_outputs.regex", "the anchor ^ is not supported there"),
        (dict(regex=r"\Aab\Z"), "structured_outputs.regex", "the anchor \\A is not supported there"),
    ]
    for spec, param, words in bad:
        with pytest.raises(InvalidRequest) as err:
            llm.generate(["x"], SamplingParams(structured_outputs=constrained(**spec)))
        assert err.value.param == param and words in err.value.message, (spec, err.value.message)
    for fine in ("^ab$", "[$^]+", r"\$\^"):  # anchors at the ends, and escaped or in a class, are fine
        constrained(regex=fine).validate()
    for spec in (dict(), dict(json=PERSON, regex="a"), dict(choice=[]), dict(choice=["a", ""])):
        with pytest.raises(InvalidRequest):
            constrained(**spec)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(structured_outputs={"jsn": {}})
    assert err.value.param == "structured_outputs.jsn"


def nested(depth: int) -> dict:
    """A schema whose JSON nests `depth` objects and arrays deep."""
    schema: dict = {"type": "integer"}
    while depth > 1:
        schema = {"type": "array", "items": schema}
        depth -= 1
    return schema


def test_schemas_are_bounded_before_xgrammar_parses_them() -> None:
    """A schema given as JSON text is parsed and held to the same limits as a dict (xgrammar's parse
    time grows about with the cube of the depth); every kind of spec has a size limit."""
    from tokenmill.engine.structured_output.params import MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES

    deep = json.dumps(nested(400))
    for schema in (deep, json.loads(deep), nested(MAX_SCHEMA_DEPTH + 1), "[" * 100_000):
        with pytest.raises(InvalidRequest, match=f"nested more than {MAX_SCHEMA_DEPTH} levels") as err:
            constrained(json=schema)
        assert err.value.param == "structured_outputs.json" and err.value.code == "structured_output_too_large"
    constrained(json=nested(MAX_SCHEMA_DEPTH)).validate()
    constrained(json=json.dumps(nested(MAX_SCHEMA_DEPTH))).validate()
    for text in ("{not json", "[1, 2]"):
        with pytest.raises(InvalidRequest) as err:
            constrained(json=text)
        assert err.value.param == "structured_outputs.json"
    big = "x" * MAX_SPEC_BYTES
    for kind, value in (
        ("regex", big + "y"),
        ("grammar", f'root ::= "{big}"'),
        ("choice", [big[:1000]] * 300),
        ("json", {"enum": [big]}),
        ("json", json.dumps({"enum": [big]})),
    ):
        with pytest.raises(InvalidRequest, match=f"the limit is {MAX_SPEC_BYTES}") as err:
            constrained(**{kind: value})
        assert err.value.param == f"structured_outputs.{kind}" and err.value.code == "structured_output_too_large"
    constrained(regex="x" * (MAX_SPEC_BYTES - 1) + "y")


# Keywords xgrammar cannot enforce, each in a schema it otherwise accepts, and an output xgrammar
# would allow that breaks it.
UNENFORCEABLE = {
    "not": {"type": "integer", "not": {"const": 3}},
    "if": {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}},
    "dependentRequired": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
    },
    "propertyNames": {"type": "object", "properties": {"ab": {"type": "integer"}}, "propertyNames": {"maxLength": 1}},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
    "format": {"type": "string", "format": "idn-email"},
    "$ref": {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCEABLE))
def test_keywords_xgrammar_cannot_enforce_are_refused_when_strict(keyword) -> None:
    schema = {"type": "object", "properties": {"x": UNENFORCEABLE[keyword]}, "required": ["x"]}
    with pytest.raises(InvalidRequest, match=re.escape(f"'{keyword}'")) as err:
        constrained(json=schema).validate()
    assert err.value.param == "structured_outputs.json" and "#/properties/x" in err.value.message
    constrained(json=schema, strict=False).validate()  # relaxed: the rest of the schema holds


def test_what_xgrammar_enforces_passes_the_strict_check() -> None:
    enforceable = [
        PERSON,
        {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "array"}]},  # types apart
        {  # a discriminator, also behind refs
            "$defs": {
                "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                "Dog": {"type": "object", "properties": {"kind": {"enum": ["dog"]}}, "required": ["kind"]},
            },
            "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
        },
        {"allOf": [{"type": "integer"}]},
        {"type": "string", "format": "date-time"},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        {"type": "object", "properties": {"self": {"$ref": "#"}}},
    ]
    for schema in enforceable:
        constrained(json=schema).validate()


def test_schema_patterns_with_misplaced_anchors_are_refused_strict_or_not() -> None:
    for strict in (True, False):
        with pytest.raises(InvalidRequest, match="the anchor \\$ is not supported there") as err:
            constrained(json={"type": "string", "pattern": "a$b"}, strict=strict).validate()
        assert "#" in err.value.message
    constrained(json={"type": "string", "pattern": "^a+$"}).validate()


def test_preempted_sequences_keep_their_grammar_state(tiny_model_dir) -> None:
    """A KV cache too small for the batch: sequences are preempted and recomputed mid-output, and
    their matchers (advanced only by landed tokens) still match what they had generated."""
    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="2MiB", block_size=16)  # 320 tokens
    outs = llm.generate(["Hello there"] * 8, SamplingParams(**SAMPLED, structured_outputs=constrained(json=PERSON)))
    assert llm.engine.scheduler.num_preemptions > 0
    assert_valid_person(outs)


def test_overlap_scheduling_fills_masks_after_the_previous_step_lands(tiny_model_dir) -> None:
    """With overlap scheduling step N+1 is prepared before step N's tokens are known; its mask must
    still come from matchers that took those tokens (a stale mask would break the JSON)."""
    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="64MiB", overlap_scheduling=True)
    try:
        assert llm.engine._model_thread is not None
        params = [SamplingParams(**SAMPLED, structured_outputs=constrained(json=PERSON))] * 8 + [
            SamplingParams(temperature=1.0, max_tokens=40)
        ] * 4
        outs = llm.generate(["Hello"] * len(params), params)
        assert_valid_person(outs[:8])
        assert all(len(o.outputs[0].token_ids) == 40 or o.outputs[0].finish_reason == "stop" for o in outs[8:])
    finally:
        llm.engine.close()


def test_padded_vocabulary_never_samples_padding(tmp_path, default_model_dir) -> None:
    """The model's vocabulary (logits width) is larger than the tokenizer's: the padding ids have
    random logits but no text, and the mask must exclude them."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    from tests.conftest import save_random_model

    tokenizer_size = 49152
    config = LlamaConfig(
        vocab_size=tokenizer_size + 77,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    model_dir = save_random_model(config, default_model_dir, tmp_path / "padded", seed=11, sharpen=False)
    weights = load_file(model_dir / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head][tokenizer_size:] *= 50  # make the padding ids the model's favourites
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB")
    free = llm.generate(["Hello"] * 4, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    assert any(t >= tokenizer_size for o in free for t in o.outputs[0].token_ids)  # the control
    outs = llm.generate(["Hello"] * 8, SamplingParams(**SAMPLED, structured_outputs=constrained(json=PERSON)))
    assert all(t < tokenizer_size for o in outs for t in o.outputs[0].token_ids)
    assert_valid_person(outs)


def test_a_slow_compile_does_not_stall_other_requests(tiny_model_dir) -> None:
    """The grammar compiles on its own thread: the engine keeps stepping the other requests, and the
    constrained request is scheduled once its grammar is ready."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB"), progress=False)
    try:
        engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        engine.step()  # the free request is decoding
        # Validation (parsing the schema) is the caller's work, like tokenizing; the engine compiles.
        request = engine.make_request(
            "slow",
            "Hello",
            SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=constrained(json=SLOW_SCHEMA)),
        )
        started = time.perf_counter()
        engine.add(request)
        add_seconds = time.perf_counter() - started
        slow = engine.output_processor.request("slow")
        compiling = engine.structured_outputs.compiling("slow")
        free_tokens = []
        while not compiling.done():
            outs = engine.step()
            free_tokens += [len(o.outputs[0].token_ids) for o in outs if o.request_id == "free"]
            assert not slow.seqs[0].output_token_ids  # not scheduled while compiling
        compile_seconds = time.perf_counter() - started
        assert add_seconds < compile_seconds / 4, (add_seconds, compile_seconds)
        assert len(free_tokens) >= 3, (free_tokens, compile_seconds)  # the free request kept decoding
        assert free_tokens == sorted(free_tokens) and free_tokens[-1] > free_tokens[0]
        final = None
        while final is None:
            final = next((o for o in engine.step() if o.request_id == "slow" and o.finished), None)
        assert final.outputs[0].finish_reason == "length" and final.outputs[0].text.startswith("{")
    finally:
        engine.close()


def test_a_failed_compile_fails_only_its_request(tiny_model_dir, monkeypatch) -> None:
    """A grammar over the memory limit is refused (the request's fault: `rejection`); the other
    request's grammar compiles and runs."""
    from tokenmill.engine.structured_output import grammar

    monkeypatch.setattr(grammar, "MAX_GRAMMAR_BYTES", 32 << 10)  # (the choice list's grammar: ~62 KiB)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB"), progress=False)
    try:
        big = constrained(choice=[f"choice number {i}" for i in range(300)])
        engine.add_request("ok", "Hi", SamplingParams(**SAMPLED, structured_outputs=constrained(regex="a{3}")))
        engine.add_request("big", "Hi", SamplingParams(**SAMPLED, structured_outputs=big))
        finished = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["ok"].outputs[0].text == "aaa"
        assert finished["big"].outputs[0].finish_reason == "error"
        assert isinstance(finished["big"].rejection, InvalidRequest)
        assert finished["big"].rejection.code == "structured_output_too_complex"
        assert "the limit is" in finished["big"].error
    finally:
        engine.close()


def test_json_strings_never_take_raw_control_characters(llm) -> None:
    """JSON strings must escape U+0000-U+001F; xgrammar 0.2.9 lets them into length-bounded strings
    (a sampled "\x15" once made a reply unparseable), so the engine tightens its string rule."""
    compiled = llm.engine.structured_outputs.compiler.compile(constrained(json=PERSON)).result()

    def accepts(text: str) -> bool:
        return llm.engine.structured_outputs.compiler.matcher(compiled).accept_string(text)

    assert accepts('{"name": "ab\u00e9') and accepts('{"name": "a b')
    for control in ("\x00", "\x15", "\t", "\x1f"):
        assert not accepts('{"name": "a' + control), repr(control)


@pytest.mark.parametrize(
    "spec",
    [{"choice": ["<|im_start|>"]}, {"regex": r"<\|im_start\|>"}, {"grammar": 'root ::= "<|im_start|>"'}],
    ids=["choice", "regex", "grammar"],
)
def test_text_equal_to_a_special_token_is_written_as_text(llm, spec) -> None:
    """The special token whose text the spec spells (biased to win if it were allowed) is never
    sampled: the output is the text, which the detokenizer would otherwise leave out."""
    im_start = llm.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = SamplingParams(max_tokens=16, structured_outputs=constrained(**spec), logit_bias={im_start: 100.0})
    out = llm.generate(["Say it"], params)[0].outputs[0]
    assert im_start not in out.token_ids
    assert out.text == "<|im_start|>" and out.finish_reason == "stop"


def test_grammars_compile_once_per_spec(llm) -> None:
    compiler = llm.engine.structured_outputs.compiler
    spec_a, spec_b = constrained(json=dict(PERSON)), constrained(json=json.loads(json.dumps(PERSON)))
    # Same schema (key order too): one compile, one grammar.
    assert compiler.compile(spec_a).result() is compiler.compile(spec_b).result()
    assert compiler.compile(constrained(regex="a")).result() is not compiler.compile(constrained(regex="b")).result()


# ---------------------------------------------------------------------------------------------- bounds


# A 15-byte regex that takes seconds to compile (xgrammar expands the repetition).
SLOW_REGEX = "[^x]{0,100000}"


def test_a_tokenizer_info_is_built_once_per_vocabulary(tiny_model_dir) -> None:
    """Engines made again over one tokenizer (separate objects, equal contents) share xgrammar's
    view of its vocabulary; another size, other stop tokens or other contents get their own."""
    from transformers import AutoTokenizer

    from tokenmill.engine.structured_output.grammar import tokenizer_info

    first, second = (AutoTokenizer.from_pretrained(tiny_model_dir) for _ in range(2))
    size = len(first) + 64
    info = tokenizer_info(first, size, [2])
    assert tokenizer_info(second, size, [2]) is info
    assert tokenizer_info(second, size + 64, [2]).vocab_size == size + 64
    assert list(tokenizer_info(second, size, [0]).stop_token_ids) == [0]
    assert second.add_tokens(["zzqx"]) == 1
    added = second.convert_tokens_to_ids("zzqx")
    assert info.decoded_vocab[added] == b""  # (padding in the first tokenizer's)
    assert tokenizer_info(second, size, [2]).decoded_vocab[added] == b"zzqx"


@pytest.fixture
def compiler(llm):
    """A grammar compiler of its own (its own workers and cache) over the tiny model's vocabulary."""
    from tokenmill.engine.structured_output.grammar import GrammarCompiler

    made = []

    def make(**kwargs):
        made.append(GrammarCompiler(llm.engine.tokenizer, llm.engine.spec.vocab_size, [2], **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_compile_past_its_deadline_is_refused_and_stopped(compiler) -> None:
    from tokenmill.engine.structured_output.grammar import GrammarTooComplex

    grammars = compiler(timeout_s=1.0)
    future = grammars.compile(constrained(regex=SLOW_REGEX))
    with pytest.raises(GrammarTooComplex, match="did not compile within 1 s") as err:
        future.result(timeout=120)
    assert err.value.param == "structured_outputs.regex"
    # Refused at once the next time (the spec's fault); a cheap spec still compiles.
    with pytest.raises(GrammarTooComplex):
        grammars.compile(constrained(regex=SLOW_REGEX)).result(timeout=1)
    assert grammars.compile(constrained(regex="ab+")).result(timeout=120) is not None


def test_a_compile_nobody_waits_for_is_stopped(compiler) -> None:
    grammars = compiler(timeout_s=600.0)
    cheap = grammars.compile(constrained(regex="warm"))  # (the worker processes are up)
    cheap.result(timeout=120)
    future = grammars.compile(constrained(regex=SLOW_REGEX + "a"))
    deadline = time.monotonic() + 60
    while not any(job.running for job in grammars._cache.values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = {w._proc.pid for w in grammars._workers if w._proc is not None}
    assert future.cancel()
    while grammars._cache.get(constrained(regex=SLOW_REGEX + "a").key) is not None:  # forgotten
        assert time.monotonic() < deadline, "the compile went on"
        time.sleep(0.05)
    gone = pids - {w._proc.pid for w in grammars._workers if w._proc is not None}
    assert gone and not any(psutil.pid_exists(pid) for pid in gone)  # its process was killed (and replaced)


def test_aborting_a_request_stops_its_compile(tiny_model_dir) -> None:
    """A request aborted (its client left) while its grammar compiles withdraws from the compile:
    nobody else waits for it, so it is dropped and its worker process killed."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB"), progress=False)
    try:
        grammars = engine.structured_outputs.compiler
        spec = constrained(regex=SLOW_REGEX + "b")
        engine.add_request("slow", "Hi", SamplingParams(max_tokens=4, structured_outputs=spec))
        deadline = time.monotonic() + 120
        while not any(job.running for job in grammars._cache.values()):  # its trial is under way
            assert time.monotonic() < deadline
            engine.step()
            time.sleep(0.05)
        pids = {w._proc.pid for w in grammars._workers if w._proc is not None}
        out = engine.abort("slow")
        assert out is not None and out.outputs[0].finish_reason == "abort"
        while grammars._cache.get(spec.key) is not None:
            assert time.monotonic() < deadline, "the compile went on"
            time.sleep(0.05)
        gone = pids - {w._proc.pid for w in grammars._workers if w._proc is not None}
        assert gone and not any(psutil.pid_exists(pid) for pid in gone)
        assert not engine.has_unfinished()
    finally:
        engine.close()


def test_an_engine_dropped_without_close_leaves_no_compiler_processes(tiny_model_dir) -> None:
    import gc

    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="16MiB")
    llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=constrained(regex="ab")))
    workers = [w._proc.pid for w in llm.engine.structured_outputs.compiler._workers if w._proc is not None]
    assert workers
    del llm
    gc.collect()
    assert not any(psutil.pid_exists(pid) for pid in workers)


def test_slow_compiles_never_queue_ahead_of_cheap_ones(compiler) -> None:
    """Heavy compiles (over the light budget) queue among themselves: a cheap spec sent after
    three of them compiles while they are still busy."""
    grammars = compiler(timeout_s=600.0)
    grammars.compile(constrained(regex="warm")).result(timeout=120)
    slow = [grammars.compile(constrained(regex=SLOW_REGEX + suffix)) for suffix in "abc"]
    time.sleep(2)  # (they are past the light budget: heavy)
    cheap = grammars.compile(constrained(json=PERSON))
    assert cheap.result(timeout=120) is not None
    assert not all(f.done() for f in slow)
    for f in slow:
        f.cancel()


def test_the_grammar_cache_is_bounded_by_memory(compiler) -> None:
    def choices(word: str) -> StructuredOutputsParams:
        return constrained(choice=[f"{word} number {i}" for i in range(300)])

    grammars = compiler(max_bytes=100_000)
    first = grammars.compile(choices("choice")).result(timeout=120)
    assert 50_000 < first.memory_size_bytes < 100_000  # two of them do not fit
    grammars.compile(choices("option")).result(timeout=120)
    assert grammars.cached_bytes <= 100_000
    assert grammars.compile(choices("choice")).result(timeout=120) is not first  # evicted, compiled anew


AMBIGUOUS = 'root ::= b* "y"\nb ::= "x"* "x"* "x"* "x"* "x"*'


def test_a_grammar_too_costly_to_match_is_stopped_and_its_neighbours_go_on(llm) -> None:
    """Every "x" makes the ambiguous grammar's matcher state grow (its work per token grows with each one):
    the request is stopped once its matching time runs over its budget; the other request in the
    same batches is untouched."""
    x = llm.engine.tokenizer.convert_tokens_to_ids("x")
    costly = SamplingParams(
        max_tokens=400, structured_outputs=constrained(grammar=AMBIGUOUS), logit_bias={x: 100.0}, ignore_eos=True
    )
    free = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out_costly, out_free = llm.generate(["x", "Hello"], [costly, free])
    assert out_costly.outputs[0].finish_reason == "error"
    assert out_costly.rejection is not None and out_costly.rejection.code == "grammar_too_expensive"
    assert set(out_costly.outputs[0].text) == {"x"} and len(out_costly.outputs[0].token_ids) < 400
    assert out_free.outputs[0].finish_reason == "length" and len(out_free.outputs[0].token_ids) == 60
