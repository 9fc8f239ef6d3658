"""GPU correctness: fp32 exactness, CUDA graphs, overlap scheduling, fp16/bf16 and int8 on CUDA,
speculative decoding.

Skipped without CUDA. `bench/gpu_check.sh` runs this module (and the benchmark) on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy, mixed_prompts, run_staggered
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _cuda_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "512MiB")
    return LLM(str(model_dir), progress=False, device="cuda", **kwargs)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_fp32_cuda_greedy_matches_hf(tiny_model_dir):
    prompts = mixed_prompts(8, 1, 200, seed=41)
    got = _tokens(_cuda_llm(tiny_model_dir, dtype="float32"), prompts)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(tiny_model_dir, prompt, 32)


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graphs_equal_eager_fp32(tiny_model_dir, overlap):
    prompts = mixed_prompts(40, 1, 300, seed=42)
    eager = run_staggered(_cuda_llm(tiny_model_dir, dtype="float32", overlap_scheduling=overlap), prompts, GREEDY)
    graphed_llm = _cuda_llm(tiny_model_dir, dtype="float32", overlap_scheduling=overlap, cuda_graphs=True)
    graphed = run_staggered(graphed_llm, prompts, GREEDY)
    graphs = graphed_llm.engine.runner.graphs
    assert graphs is not None and len({b for b, _ in graphs.graphs}) >= 3, graphs.graphs
    assert graphed == eager
    assert not graphed_llm.engine.kv_cache.data[:, 0].any()  # padding rows never wrote the zero block


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_on_cuda_equals_plain_greedy(tiny_model_dir, method):
    """Speculation on CUDA with decode graphs asked for: steps with draft tokens run eagerly, the
    others may replay graphs; greedy tokens equal plain decoding (the model as its own draft)."""
    prompts = [p * 3 for p in mixed_prompts(12, 3, 20, seed=45)] + mixed_prompts(8, 1, 120, seed=46)
    plain = run_staggered(_cuda_llm(tiny_model_dir, dtype="float32"), prompts, GREEDY)
    draft = {"speculative_model": str(tiny_model_dir)} if method == "draft" else {}
    llm = _cuda_llm(tiny_model_dir, dtype="float32", cuda_graphs=True, speculative_method=method, **draft)
    assert run_staggered(llm, prompts, GREEDY) == plain
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_cuda_graphs_fp16_agree_with_eager(tiny_model_dir):
    prompts = mixed_prompts(32, 1, 200, seed=43)
    eager = _tokens(_cuda_llm(tiny_model_dir, dtype="float16"), prompts)
    graphed = _tokens(_cuda_llm(tiny_model_dir, dtype="float16", cuda_graphs=True), prompts)
    # Same kernels on differently padded shapes: fp16 rounding may flip a near-tie late in a sequence.
    first8 = sum(a[:8] == b[:8] for a, b in zip(eager, graphed)) / len(prompts)
    assert first8 >= 0.9, first8


def test_overlap_equals_sync_on_cuda_for_seeded_sampling(tiny_model_dir):
    prompts = mixed_prompts(12, 5, 100, seed=44)
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=24, top_p=0.95, frequency_penalty=0.3, stop=["ab"])
        for i in range(12)
    ]
    sync = _cuda_llm(tiny_model_dir, dtype="float32", overlap_scheduling=False).generate(prompts, params)
    overlap = _cuda_llm(tiny_model_dir, dtype="float32", overlap_scheduling=True, cuda_graphs=True).generate(
        prompts, params
    )
    assert [o.outputs[0].token_ids for o in sync] == [o.outputs[0].token_ids for o in overlap]


def test_auto_dtype_is_half_precision_and_generates(tiny_model_dir):
    llm = _cuda_llm(tiny_model_dir)
    assert llm.engine.dtype in (torch.bfloat16, torch.float16)
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_int8_weights_on_cuda_agree_with_fp16(tiny_model_dir):
    prompts = mixed_prompts(16, 5, 40, seed=45)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    half = _tokens(_cuda_llm(tiny_model_dir, dtype="float16"), prompts, params)
    int8 = _tokens(_cuda_llm(tiny_model_dir, dtype="float16", quantization="int8", cuda_graphs=True), prompts, params)
    agreement = sum(a[0] == b[0] for a, b in zip(half, int8)) / len(prompts)
    assert agreement >= 0.75, agreement


# ---- model coverage, LoRA, KV dtype, prefix cache and structured output on CUDA ----------------
# The CPU suite pins these to CPU tensors; here the same checks run with CUDA tensors, kernels,
# graphs and (by default on CUDA) overlap scheduling.

NATIVE_FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
]
GENERIC_FAMILIES = ["llama", "gemma2", "falcon", "gpt_bigcode", "olmoe", "deepseek_v3"]
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def families_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _assert_hf_greedy(llm: LLM, hf_model, prompts) -> None:
    from tests.models.test_models_generic import _hf_greedy

    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, SHORT))):
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, prompt, SHORT.max_tokens), f"prompt {i}"


@pytest.mark.parametrize("model_type", NATIVE_FAMILIES)
def test_native_families_on_cuda_match_hf(model_type, families_root):
    """fp32 on CUDA with decode graphs, chunked prefill (32-token chunks) and prompts longer than the
    sliding windows (8): greedy == HF fp32 on the CPU."""
    from tests.models.test_models_generic import _built, _prompts
    from tokenmill.models.model_loader.transformers_backend import TransformersCausalLM

    model_dir, hf_model = _built(model_type, families_root)
    llm = _cuda_llm(model_dir, dtype="float32", kv_cache_memory="64MiB", cuda_graphs=True, max_num_batched_tokens=32)
    assert not isinstance(llm.engine.model, TransformersCausalLM)  # the native path
    _assert_hf_greedy(llm, hf_model, _prompts(6, 3, 60, seed=7))
    if getattr(llm.engine.model, "supports_cuda_graphs", True):
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs


@pytest.mark.parametrize("model_type", GENERIC_FAMILIES)
def test_generic_path_on_cuda_matches_hf(model_type, families_root):
    from tests.models.test_models_generic import _built, _prompts
    from tokenmill.models.model_loader.transformers_backend import TransformersCausalLM

    model_dir, hf_model = _built(model_type, families_root)
    llm = _cuda_llm(
        model_dir, dtype="float32", kv_cache_memory="64MiB", model_impl="transformers", max_num_batched_tokens=32
    )
    assert isinstance(llm.engine.model, TransformersCausalLM)
    _assert_hf_greedy(llm, hf_model, _prompts(6, 3, 60, seed=8))


def test_moe_grouped_gemm_in_bf16_agrees_with_the_expert_loop(families_root, monkeypatch):
    """bf16 MoE on CUDA takes torch's grouped GEMM (and so can be graphed); the per-expert loop is the
    reference. Same model, same dtype: greedy tokens agree apart from rare bf16 near-ties."""
    from tests.models.test_models_generic import _built, _prompts
    from tokenmill.models.layers import moe

    model_dir, _ = _built("qwen3_moe", families_root)
    prompts = _prompts(16, 3, 60, seed=9)
    grouped = _cuda_llm(model_dir, dtype="bfloat16", kv_cache_memory="64MiB", cuda_graphs=True)
    assert grouped.engine.model.supports_cuda_graphs and grouped.engine.runner.graphs is not None
    fast = _tokens(grouped, prompts, SHORT)
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda weight: False)
    loop = _tokens(_cuda_llm(model_dir, dtype="bfloat16", kv_cache_memory="64MiB"), prompts, SHORT)
    first4 = sum(a[:4] == b[:4] for a, b in zip(fast, loop)) / len(prompts)
    assert first4 >= 0.85, first4


def test_lora_adapters_on_cuda_match_peft(sharp_tiny_model_dir, tmp_path):
    """Three adapters and the base model in one CUDA batch (the GEMM paths): greedy == HF + peft."""
    pytest.importorskip("peft")
    from tests.utils.lora import make_peft_adapter, peft_greedy
    from tokenmill import LoRARequest

    attention, mlp = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
    adapters = {
        "all": make_peft_adapter(
            sharp_tiny_model_dir, tmp_path / "all", seed=1, r=8, lora_alpha=16, target_modules=attention + mlp
        ),
        "qv": make_peft_adapter(
            sharp_tiny_model_dir,
            tmp_path / "qv",
            seed=2,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
        ),
        "mlp": make_peft_adapter(
            sharp_tiny_model_dir,
            tmp_path / "mlp",
            seed=3,
            r=16,
            lora_alpha=32,
            target_modules=mlp,
            rank_pattern={"down_proj": 2},
        ),
    }
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())] + [None]
    llm = _cuda_llm(
        sharp_tiny_model_dir,
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_num_batched_tokens=96,
    )
    prompts = mixed_prompts(8, 3, 60, seed=11)
    choices = [requests[i % 4] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    for i, (prompt, out, choice) in enumerate(
        zip(prompts, llm.generate(prompts, params, lora_request=choices), choices)
    ):
        adapter = None if choice is None else choice.lora_path
        assert out.outputs[0].token_ids == peft_greedy(sharp_tiny_model_dir, adapter and Path(adapter), prompt, 10), i
        if choice is not None:  # the adapter matters, so the check above could fail
            assert peft_greedy(sharp_tiny_model_dir, Path(adapter), prompt, 10) != peft_greedy(
                sharp_tiny_model_dir, None, prompt, 10
            ), choice.lora_name


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_narrow_kv_cache_under_an_fp32_model_on_cuda(sharp_tiny_model_dir, kv_dtype):
    """bf16 or int8 (quantized rows + scales, read back by the torch path) K/V under CUDA graphs. The
    same prompts on the CPU, either attention path: bf16 16/16, int8 14/16 first-4 tokens agree."""
    prompts = mixed_prompts(16, 5, 120, seed=12)
    full = _tokens(_cuda_llm(sharp_tiny_model_dir, dtype="float32"), prompts, SHORT)
    llm = _cuda_llm(
        sharp_tiny_model_dir, dtype="float32", kv_cache_dtype=str(kv_dtype).removeprefix("torch."), cuda_graphs=True
    )
    assert llm.engine.kv_cache.data.dtype == kv_dtype
    narrow = _tokens(llm, prompts, SHORT)
    first4 = sum(a[:4] == b[:4] for a, b in zip(full, narrow)) / len(prompts)
    assert first4 >= 0.75, first4


def test_prefix_cache_hits_on_cuda_keep_tokens_exact(sharp_tiny_model_dir):
    """Requests sharing a 96-token prefix: the later ones reuse its KV blocks and still equal HF."""
    shared = mixed_prompts(1, 96, 96, seed=13)[0]
    prompts = [shared + tail for tail in mixed_prompts(6, 2, 20, seed=14)]
    llm = _cuda_llm(sharp_tiny_model_dir, dtype="float32", cuda_graphs=True)
    llm.generate(prompts[:1], SHORT)
    got = _tokens(llm, prompts[1:], SHORT)
    assert llm.engine.stats().prefix_cache_hits_total > 0
    for prompt, tokens in zip(prompts[1:], got):
        assert tokens == hf_greedy(sharp_tiny_model_dir, prompt, SHORT.max_tokens)


def test_json_schema_outputs_validate_on_cuda(tiny_model_dir):
    """xgrammar's token bitmask applied to CUDA logits, sampled, with overlap scheduling and graphs."""
    pytest.importorskip("xgrammar")
    import json

    from tokenmill.engine.structured_output.params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    llm = _cuda_llm(tiny_model_dir, dtype="float32", cuda_graphs=True)
    outs = llm.generate(
        ["Hello"] * 12,
        SamplingParams(
            temperature=1.0, max_tokens=128, seed=3, structured_outputs=StructuredOutputsParams(json=schema)
        ),
    )
    for out in outs:
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120 and len(value["name"]) <= 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_batch_invariance_on_cuda(tiny_model_dir, dtype):
    """--batch-invariant on CUDA (library kernels on fixed shapes, models/layers/fixed_shapes.py): each
    prompt's greedy tokens alone equal those in staggered batches with chunked prefill and prefix-cache
    hits, and with n-gram speculation (its verification pass)."""
    from tests.engine.test_batch_invariance import _prompts

    prompts = _prompts()
    plain = _cuda_llm(tiny_model_dir, dtype=dtype, batch_invariant=True, enable_prefix_caching=False)
    alone = [_tokens(plain, [p])[0] for p in prompts]
    mixed = _cuda_llm(tiny_model_dir, dtype=dtype, batch_invariant=True, max_num_batched_tokens=48)
    assert run_staggered(mixed, prompts, GREEDY, per_step=3) == alone
    speculative = _cuda_llm(tiny_model_dir, dtype=dtype, batch_invariant=True, speculative_method="ngram")
    assert run_staggered(speculative, prompts, GREEDY, per_step=3) == alone
    assert speculative.engine.stats().spec_decode_num_accepted_tokens > 0
