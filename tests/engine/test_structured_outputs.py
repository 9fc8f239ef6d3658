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
    """The control: the same model and sampling unconstrained is not JSON, so the tests above can fail."""
    outs = llm.generate(["Hello"] * 8, SamplingParams(temperature=1.0, max_tokens=24))
    for text in texts(outs):
        with pytest.raises(ValueError):
            jiter.from_json(text.encode(), partial_mode="trailing-strings")


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
    ]
    for spec, param, words in bad:
        with pytest.raises(InvalidRequest) as err:
            llm.generate(["x"], SamplingParams(structured_outputs=constrained(**spec)))
        assert err.value.param == param and words in err.value.message, (spec, err.value.message)
    for spec in (dict(), dict(json=PERSON, regex="a"), dict(choice=[]), dict(choice=["a", ""])):
        with pytest.raises(InvalidRequest):
            constrained(**spec)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(structured_outputs={"jsn": {}})
    assert err.value.param == "structured_outputs.jsn"


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
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="64MiB"), progress=False)
    try:
        compile_grammar = engine.structured_outputs.compiler._compile

        def failing(spec):
            if spec.regex == "b+":
                raise RuntimeError("out of memory while compiling")
            return compile_grammar(spec)

        monkeypatch.setattr(engine.structured_outputs.compiler, "_compile", failing)
        engine.add_request("ok", "Hi", SamplingParams(**SAMPLED, structured_outputs=constrained(regex="a{3}")))
        engine.add_request("bad", "Hi", SamplingParams(**SAMPLED, structured_outputs=constrained(regex="b+")))
        finished = {}
        while engine.has_unfinished():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["ok"].outputs[0].text == "aaa"
        assert finished["bad"].outputs[0].finish_reason == "error"
        assert "could not be compiled" in finished["bad"].error and "out of memory" in finished["bad"].error
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
    assert compiler.compile(spec_a) is compiler.compile(spec_b)  # same schema, one compile (key order too)
    assert compiler.compile(constrained(regex="a")) is not compiler.compile(constrained(regex="b"))
