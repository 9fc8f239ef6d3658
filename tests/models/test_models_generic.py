"""The generic transformers path: greedy tokens equal HF generate for many architectures, and the
models it cannot run fail at load with the reason.

Every model is a tiny random-init one built from a transformers config class (2 layers, hidden 64,
vocabulary 512) with weights sharpened (`sharpen_weights`) so that attention is peaked and a wrong mask, scale or
position changes tokens. Prompts are token ids (no tokenizer needed) of mixed lengths, batched;
the reference is HF `generate` on the same in-memory model, one prompt at a time, fp32, no padding.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from tests.conftest import sharpen_weights
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.models.model_loader.transformers_backend import (
    TESTED_ARCHITECTURES,
    TransformersCausalLM,
    UnsupportedModelError,
)

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_OMIT = object()  # a COMMON key this config class does not take
_LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_shared_experts=1,
    num_key_value_heads=4,
)

# model_type -> config keys beyond COMMON. Native families are here too: the matrix forces every
# model through the generic path.
MATRIX: dict[str, dict] = {
    "llama": dict(attention_bias=True),  # bias on q/k/v and o_proj
    "mistral": dict(sliding_window=8),  # every layer slides
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": {},
    "gpt2": dict(n_positions=512),
    "gemma": {},  # embeddings scaled by sqrt(hidden), (1 + w) RMSNorm
    # attention and final logit softcapping, local/global layers:
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(sliding_window=8, layer_types=_LOCAL_GLOBAL),  # + q/k norms, local RoPE base
    "cohere2": dict(sliding_window=8, layer_types=_LOCAL_GLOBAL),
    "exaone4": dict(sliding_window=8, layer_types=_LOCAL_GLOBAL),
    "olmo3": dict(sliding_window=8, layer_types=_LOCAL_GLOBAL),
    "ministral": dict(sliding_window=8, layer_types=_LOCAL_GLOBAL),
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": {},
    "gpt_neox": dict(rotary_pct=0.5),
    "gptj": dict(rotary_dim=8),
    "gpt_bigcode": dict(multi_query=True),
    "opt": {},
    "falcon": dict(head_dim=_OMIT, new_decoder_architecture=True, num_kv_heads=2),  # grouped fused qkv
    "stablelm": dict(partial_rotary_factor=0.5, use_qkv_bias=True),
    "olmo": {},
    "olmo2": {},
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, attention_multiplier=0.2),
    "cohere": dict(logit_scale=0.5, use_qk_norm=True),
    "smollm3": {},
    "starcoder2": {},
    "glm": {},
    "glm4": {},
    "helium": {},
    "arcee": {},
    "ernie4_5": {},
    "seed_oss": {},
    "nemotron": {},
    "persimmon": {},
    "apertus": {},
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=64),
    "qwen3_moe": _MOE,
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(_MLA, head_dim=8),  # MLA: K head size 24, V head size 16
}

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _config(model_type: str, **overrides):
    from transformers import AutoConfig

    keys = {**COMMON, **MATRIX.get(model_type, {}), **overrides}
    return AutoConfig.for_model(model_type, **{k: v for k, v in keys.items() if v is not _OMIT})


def _save(config, target: Path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    sharpen_weights(model, seed)
    model.save_pretrained(target)
    return model


@functools.cache
def _built(model_type: str, tmp_root: Path, **overrides) -> tuple[Path, torch.nn.Module]:
    target = tmp_root / model_type
    model = _save(_config(model_type, **overrides), target)
    return target, model


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("generic")


def _prompts(count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _generic_llm(model_dir: Path, **engine_args) -> LLM:
    llm = LLM(str(model_dir), progress=False, model_impl="transformers", **{"kv_cache_memory": "8MiB", **engine_args})
    assert isinstance(llm.engine.model, TransformersCausalLM)
    return llm


def _assert_greedy_equal(llm: LLM, hf_model, prompts, params: SamplingParams = GREEDY) -> None:
    outs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, prompt, params.max_tokens), f"prompt {i}"


@pytest.mark.unit
def test_matrix_is_what_the_registry_calls_tested():
    assert set(MATRIX) == set(TESTED_ARCHITECTURES)


@pytest.mark.parametrize("model_type", sorted(MATRIX))
def test_greedy_matches_hf(model_type, tmp_root):
    model_dir, hf_model = _built(model_type, tmp_root)
    _assert_greedy_equal(_generic_llm(model_dir), hf_model, _prompts(4, 1, 40, seed=len(model_type)))


@pytest.mark.parametrize("model_type", ["granite", "cohere", "gemma2"])
def test_logprobs_match_hf_scaled_logits(model_type, tmp_root):
    """Greedy tokens do not see a logit scale or final softcapping; log-probabilities do."""
    model_dir, hf_model = _built(model_type, tmp_root)
    prompt = _prompts(1, 12, 12, seed=5)[0]
    out = _generic_llm(model_dir).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))[0]
    tokens = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    got = torch.tensor([lp for lp, _ in out.outputs[0].logprobs])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_mix(tmp_root):
    """Prompts longer than the step budget are prefilled in chunks next to running decodes."""
    model_dir, hf_model = _built("qwen3", tmp_root)
    llm = _generic_llm(model_dir, max_num_batched_tokens=16)
    _assert_greedy_equal(llm, hf_model, _prompts(5, 20, 60, seed=3))


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_sliding_window_with_chunked_prefill(model_type, tmp_root):
    """Prompts of 3-7 windows, prefilled in chunks of up to 16 tokens, then decoded: every chunk and
    decode attends only to its window on sliding layers (window 8; gemma3: every other layer)."""
    model_dir, hf_model = _built(model_type, tmp_root)
    llm = _generic_llm(model_dir, max_num_batched_tokens=16)
    _assert_greedy_equal(llm, hf_model, _prompts(4, 24, 56, seed=11))


def test_prefix_cache_hit(tmp_root):
    model_dir, hf_model = _built("olmo2", tmp_root)
    llm = _generic_llm(model_dir, enable_prefix_caching=True)
    shared = _prompts(1, 40, 40, seed=8)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]
    _assert_greedy_equal(llm, hf_model, [first])
    _assert_greedy_equal(llm, hf_model, [second])
    assert llm.engine.stats().prefix_cache_hits_total >= 32  # two full 16-token blocks reused


def test_preemption_under_a_tiny_kv_budget(tmp_root):
    """12 blocks of 16 tokens: 6 prompts of 2 blocks each all start, then each needs a third block
    to decode: some are preempted and recomputed, and still give HF's tokens."""
    from tokenmill.engine.worker.kv_cache import bytes_per_block

    model_dir, hf_model = _built("olmo2", tmp_root)
    budget = 13 * bytes_per_block(16, 2, 2, 16, torch.float32)  # (block 0 is the zero block)
    llm = _generic_llm(model_dir, kv_cache_memory=str(budget), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _assert_greedy_equal(llm, hf_model, _prompts(6, 26, 31, seed=4), params)
    assert llm.engine.stats().num_preemptions_total > 0


def test_tensor_parallelism_needs_the_native_path(tmp_root):
    model_dir, _ = _built("olmo2", tmp_root)
    with pytest.raises(ValueError, match="needs the native path"):
        LLM(str(model_dir), progress=False, kv_cache_memory="8MiB", tensor_parallel_size=2)


def test_auto_picks_native_for_native_families_and_generic_otherwise(tmp_root):
    llama_dir, _ = _built("llama", tmp_root)
    olmo_dir, _ = _built("olmo2", tmp_root)
    assert not isinstance(
        LLM(str(llama_dir), progress=False, kv_cache_memory="8MiB").engine.model, TransformersCausalLM
    )
    assert isinstance(LLM(str(olmo_dir), progress=False, kv_cache_memory="8MiB").engine.model, TransformersCausalLM)
    with pytest.raises(ValueError, match="'olmo2' has no native path"):
        LLM(str(olmo_dir), progress=False, kv_cache_memory="8MiB", model_impl="native")


# -- models the generic path refuses --------------------------------------------------------------


def _refused(config, tmp_path: Path, match: str) -> None:
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # no causal LM class (T5): save the base model
        model = AutoModel.from_config(config)
    model.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=match) as info:
        LLM(str(tmp_path), progress=False, kv_cache_memory="8MiB", model_impl="transformers")
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_state_space_model_is_refused(tmp_path):
    from transformers import MambaConfig

    _refused(
        MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2),
        tmp_path,
        "MambaForCausalLM does not support custom attention functions",
    )


def test_encoder_decoder_is_refused(tmp_path):
    from transformers import T5Config

    _refused(
        T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4),
        tmp_path,
        "'t5' is an encoder-decoder model",
    )


def test_convolution_layers_are_refused(tmp_path):
    from transformers import Lfm2Config

    config = Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
    )
    _refused(config, tmp_path, "layers of type conv: the generic path runs full and sliding-window attention")


def test_alibi_is_refused(tmp_path):
    _refused(_config("falcon", new_decoder_architecture=False, alibi=True), tmp_path, "ALiBi position biases")


def test_attention_sinks_are_refused(tmp_path):
    config = _config("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    _refused(config, tmp_path, "attention sinks s_aux")


def test_model_passing_its_own_attention_mask_is_refused(tmp_path):
    from transformers import DogeConfig

    config = DogeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    _refused(config, tmp_path, "passes its own attention mask")


def test_layer_calling_attention_twice_is_refused(tmp_path):
    from transformers import DiffLlamaConfig

    config = DiffLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    _refused(config, tmp_path, "do not each call attention once")


def test_tokens_mixing_outside_attention_is_refused(tmp_path, monkeypatch):
    """A layer that shifts tokens along the sequence (like a convolution or RWKV's token shift)
    would mix the sequences of a flattened batch: the load-time probe catches it."""
    from transformers.models.llama import modeling_llama

    model_dir = tmp_path / "llama"
    _save(_config("llama"), model_dir)
    plain_forward = modeling_llama.LlamaMLP.forward

    def token_shift(self, x):
        return plain_forward(self, x + torch.roll(x, 1, dims=1))

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", token_shift)
    with pytest.raises(UnsupportedModelError, match="carries state along the tokens outside attention"):
        _generic_llm(model_dir)


def test_checkpoint_with_extra_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "llama"
    _save(_config("qwen3"), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.layers.0.mlp.surprise.weight"] = torch.zeros(2, 2)
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.surprise.weight"):
        _generic_llm(model_dir)


@pytest.mark.unit
def test_models_command_marks_generic_and_native_paths(capsys):
    import json

    from tokenmill.cli import main

    assert main(["models", "--json"]) == 0
    rows = {row["model_type"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["llama"]["path"] == "native"
    for model_type in TESTED_ARCHITECTURES:
        if rows[model_type]["path"] == "generic":
            assert "tested" in rows[model_type]["features"]
    assert rows["olmo2"]["path"] == "generic" and rows["olmo2"]["architectures"] == ["Olmo2ForCausalLM"]


def test_no_layer_kernels_are_fetched_from_the_hub(tmp_root):
    """transformers >= 5.25 swaps layers for kernels downloaded from the Hub (`use_kernels` defaults on,
    CUDA devices hit the network at load): tokenmill loads nothing at run time and keeps HF's own layers."""
    from tokenmill.models.model_loader.transformers_backend import load_hf_model

    model_dir, _ = _built("llama", tmp_root)
    assert load_hf_model(model_dir, torch.float32, torch.device("cpu")).use_kernels is False
