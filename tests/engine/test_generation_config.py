"""--generation-config (the model's sampling defaults for requests that set none) and --chat-template
(a file, or the template itself), as vLLM takes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenmill.engine.setup import generation_defaults, load_chat_template


@pytest.fixture(scope="module")
def model_with_defaults(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model whose generation_config.json recommends sampling settings and a length."""
    target = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("gen-config") / "model"))
    config = json.loads((target / "generation_config.json").read_text())
    recommended = {"do_sample": True, "temperature": 0.6, "top_k": 7, "top_p": 0.9, "max_new_tokens": 5}
    (target / "generation_config.json").write_text(json.dumps({**config, **recommended}))
    return target


def test_generation_config_choices(model_with_defaults, tiny_model_dir, tmp_path):
    expected = {"temperature": 0.6, "top_k": 7, "top_p": 0.9, "max_tokens": 5}
    assert generation_defaults("auto", model_with_defaults) == expected
    assert generation_defaults("vllm", model_with_defaults) == {}
    assert generation_defaults(str(model_with_defaults), tiny_model_dir) == expected
    assert generation_defaults("auto", tiny_model_dir) == {}  # (bos/eos only: nothing to apply)
    with pytest.raises(ValueError, match="no generation_config.json there"):
        generation_defaults(str(tmp_path), tiny_model_dir)


def test_requests_get_the_defaults_for_what_they_leave_unset(model_with_defaults):
    """The offline API without SamplingParams, and an API request without temperature or max_tokens:
    the model's recommendations; a request that sets a value keeps it."""
    from tokenmill import LLM
    from tokenmill.server.protocol import CompletionRequest

    llm = LLM(str(model_with_defaults), progress=False, kv_cache_memory="16MiB")
    defaults = llm.engine.generation_defaults
    params = llm.engine.default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 7, 0.9, 5)
    out = llm.generate([[1, 2, 3]])[0].outputs[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    unset = CompletionRequest(prompt="x").sampling_params(max_tokens=4, logprobs=None, defaults=defaults)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.max_tokens) == (0.6, 7, 0.9, 4)
    chosen = CompletionRequest(prompt="x", temperature=1.0, top_k=-1).sampling_params(4, None, defaults=defaults)
    assert (chosen.temperature, chosen.top_k, chosen.top_p) == (1.0, -1, 0.9)
    nulls = CompletionRequest.model_validate({"prompt": "x", "temperature": None})  # null: "not set"
    assert nulls.sampling_params(4, None, defaults=defaults).temperature == 0.6
    llm.engine.close()
    plain = LLM(str(model_with_defaults), progress=False, kv_cache_memory="16MiB", generation_config="vllm")
    assert plain.engine.generation_defaults == {} and plain.engine.default_sampling_params().temperature == 1.0
    plain.engine.close()


def test_chat_template_from_a_file_or_inline(tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template
    assert load_chat_template(template) == template
    assert load_chat_template("{{ 'a' }}\\n{{ 'b' }}") == "{{ 'a' }}\n{{ 'b' }}"  # (escapes decoded, as vLLM does)
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


def test_chat_template_replaces_the_tokenizers(tiny_model_dir):
    from tokenmill import LLM

    llm = LLM(
        str(tiny_model_dir), progress=False, kv_cache_memory="16MiB", chat_template="{{ messages[0]['content'] }}!"
    )
    ids = llm.engine.input_processor.render_chat([{"role": "user", "content": "hello"}])
    assert llm.tokenizer.decode(ids) == "hello!"
    llm.engine.close()
