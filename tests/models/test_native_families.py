"""Native model families: greedy tokens equal HF generate (fp32, sharpened random weights) on
batched mixed-length prompts, chunked prefill and prefix caching on, prompts longer than the
sliding window where the family has one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TEST_WINDOW, hf_greedy, mixed_prompts, save_random_model
from tokenmill import LLM, SamplingParams
from tokenmill.models.model_loader.loader import load_spec

SMALL = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(
        **SMALL,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=TEST_WINDOW,
        max_window_layers=1,
        tie_word_embeddings=False,
    )


def _gemma():
    from transformers import GemmaConfig

    return GemmaConfig(**SMALL, hidden_act="gelu_pytorch_tanh")


def _gemma2():
    from transformers import Gemma2Config

    # Softcaps low enough to bite at sharpened-weight logit sizes; query scalar != head_dim.
    return Gemma2Config(
        **SMALL,
        sliding_window=TEST_WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    # Layers: sliding, full, sliding; the global RoPE has linear scaling, the local one its own base.
    return Gemma3TextConfig(
        **SMALL,
        sliding_window=TEST_WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )


PHI3_ORIGINAL_MAX = 32


def _phi3():
    from transformers import Phi3Config

    # Half the head dims rotate; LongRoPE with distinct short/long factors past 32 positions.
    small = {k: v for k, v in SMALL.items() if k != "head_dim"}
    return Phi3Config(
        **small,
        original_max_position_embeddings=PHI3_ORIGINAL_MAX,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.7, 2.2],
            "long_factor": [1.5, 3.0, 6.0, 12.0],
            "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
            "factor": SMALL["max_position_embeddings"] / PHI3_ORIGINAL_MAX,
        },
    )


CONFIGS = {"qwen3": _qwen3, "gemma": _gemma, "gemma2": _gemma2, "gemma3_text": _gemma3, "phi3": _phi3}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """One tiny sharpened model directory per family, built on first use."""
    built: dict[str, Path] = {}

    class Lazy(dict):
        def __missing__(self, name: str) -> Path:
            target = tmp_path_factory.mktemp(f"tiny-{name}")
            built[name] = save_random_model(CONFIGS[name](), default_model_dir, target, seed=len(built) + 10)
            return built[name]

    return Lazy()


def _greedy_matches_hf(model_dir: Path, prompts: list[list[int]], params: SamplingParams, **engine_args) -> None:
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=32, **engine_args)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, params.max_tokens), (
            f"{len(prompt)}-token prompt"
        )


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_greedy_matches_hf(family, family_dirs):
    model_dir = family_dirs[family]
    assert load_spec(model_dir).model_type == family
    # Up to ~6x the window; >32 tokens prefill in chunks. Phi-3 serves 512 positions here, past
    # LongRoPE's original 32: long factors throughout, as HF for prompts longer than 32.
    shortest = PHI3_ORIGINAL_MAX + 1 if family == "phi3" else 1
    prompts = mixed_prompts(6, shortest, 70, seed=31)
    _greedy_matches_hf(model_dir, prompts, SamplingParams(temperature=0.0, max_tokens=16))


def test_layer_windows_and_ropes(family_dirs):
    gemma2, gemma3, qwen3 = (load_spec(family_dirs[f]) for f in ("gemma2", "gemma3_text", "qwen3"))
    assert gemma2.layer_windows == gemma3.layer_windows == (TEST_WINDOW, None, TEST_WINDOW)
    assert qwen3.layer_windows == (None, TEST_WINDOW, TEST_WINDOW)
    assert gemma3.local_rope is not None and gemma3.rope.inv_freq[1] != gemma3.local_rope.inv_freq[1]
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.attn_scale) == (3.0, 4.0, 24**-0.5)


def test_phi3_short_context_uses_short_factors(family_dirs):
    """--max-model-len within LongRoPE's original length: short factors, as HF for such sequences."""
    model_dir = family_dirs["phi3"]
    spec = load_spec(model_dir)
    assert spec.rope.long_from == PHI3_ORIGINAL_MAX and spec.rope.inv_freq.shape == (4,)  # half of 16 dims rotate
    prompts = mixed_prompts(4, 1, PHI3_ORIGINAL_MAX - 12, seed=32)
    _greedy_matches_hf(
        model_dir,
        prompts,
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        max_model_len=PHI3_ORIGINAL_MAX,
    )


def test_gemma2_final_softcap_sets_the_logprobs(family_dirs):
    """Final logit softcapping is monotonic (greedy tokens cannot show it): compare logprobs with HF's."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = family_dirs["gemma2"]
    prompt = mixed_prompts(1, 20, 20, seed=33)[0]
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=1))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    expected = torch.log_softmax(logits.float(), dim=-1)[torch.arange(4), torch.tensor(out.token_ids)]
    assert logits.abs().max() <= 4.0  # the cap is in force
    assert [lp for lp, _ in out.logprobs] == pytest.approx(expected.tolist(), abs=1e-4)
