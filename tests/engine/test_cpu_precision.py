"""CPU capabilities and `--dtype auto`, for both kinds of machine this project runs on.

The CPU under the tests may be an AVX2-only AMD EPYC or an Intel Xeon with AVX-512/AMX: the
capabilities are faked from real /proc/cpuinfo flag sets, so every branch runs on either.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tokenmill.engine import precision
from tokenmill.kernels.cpu_caps import caps_from_flags

# /proc/cpuinfo flags (the ones that matter, plus neighbours) of the two machine kinds.
ZEN3 = {
    "fpu",
    "sse",
    "sse2",
    "ssse3",
    "sse4_1",
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi1",
    "bmi2",
    "sha_ni",
    "vaes",
    "vpclmulqdq",
}
SAPPHIRE_RAPIDS = ZEN3 | {
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_bf16",
    "amx_tile",
    "amx_int8",
}
COOPER_LAKE = ZEN3 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512dq", "avx512bw", "avx512vl"}


def test_caps_from_real_flag_sets():
    zen3 = caps_from_flags(ZEN3, "AVX2")
    assert (zen3.vector_isa, zen3.native_bf16, zen3.int8_dot) == ("avx2", False, False)
    spr = caps_from_flags(SAPPHIRE_RAPIDS, "AVX512")
    assert (spr.vector_isa, spr.native_bf16, spr.amx_bf16, spr.amx_int8, spr.int8_dot) == (
        "avx512",
        True,
        True,
        True,
        True,
    )
    cooper = caps_from_flags(COOPER_LAKE, "AVX512")
    assert (cooper.native_bf16, cooper.amx_bf16) == (True, False)
    assert not caps_from_flags(SKYLAKE_X, "AVX512").native_bf16
    # AMX tiles need amx_tile too (a kernel without tile support reports amx_bf16 alone).
    assert not caps_from_flags(ZEN3 | {"amx_bf16"}, "AVX2").amx_bf16


def test_torch_dispatch_level_caps_the_kernel_isa():
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine: the kernels must not use AVX-512 either.
    assert caps_from_flags(SAPPHIRE_RAPIDS, "AVX2").vector_isa == "avx2"
    assert caps_from_flags(SAPPHIRE_RAPIDS, "DEFAULT").vector_isa == "generic"
    assert caps_from_flags(set(), "DEFAULT").vector_isa == "generic"


@pytest.mark.parametrize(
    ("flags", "source", "expected"),
    [
        (SAPPHIRE_RAPIDS, "bfloat16", torch.bfloat16),
        (SAPPHIRE_RAPIDS, "float16", torch.bfloat16),
        (COOPER_LAKE, "bfloat16", torch.bfloat16),
        (SAPPHIRE_RAPIDS, "float32", torch.float32),  # published in fp32: stays fp32
        (SAPPHIRE_RAPIDS, None, torch.float32),
        (ZEN3, "bfloat16", torch.float32),  # no native bf16: bf16 would be slower
        (SKYLAKE_X, "bfloat16", torch.float32),
    ],
)
def test_auto_dtype_on_cpu(flags, source, expected):
    dtype, reason = precision.choose_cpu_dtype(caps_from_flags(flags, "AVX512"), source)
    assert dtype == expected
    assert reason


def test_model_source_dtype(tmp_path, default_model_dir):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert precision.model_source_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert precision.model_source_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text("{}")
    assert precision.model_source_dtype(tmp_path) is None
    # The bundled model is stored in fp32 (dequantised GGUF) but published in bf16.
    assert precision.model_source_dtype(default_model_dir) == "bfloat16"


def test_explicit_dtype_wins(monkeypatch):
    monkeypatch.setattr(precision, "detect", lambda: caps_from_flags(SAPPHIRE_RAPIDS, "AVX512"))
    assert precision.resolve_dtype("float32", torch.device("cpu"), None) == torch.float32
    assert precision.resolve_dtype("bfloat16", torch.device("cpu"), None) == torch.bfloat16


@pytest.mark.parametrize(("flags", "expected"), [(SAPPHIRE_RAPIDS, torch.bfloat16), (ZEN3, torch.float32)])
def test_engine_auto_dtype_follows_the_cpu(monkeypatch, caplog, tmp_path, tiny_model_dir, flags, expected):
    from tokenmill import LLM

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("torch_dtype", None)
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    monkeypatch.setattr(precision, "detect", lambda: caps_from_flags(flags, "AVX512"))
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.precision"):
        llm = LLM(str(model_dir), progress=False, kv_cache_memory="16MiB")
    assert llm.engine.dtype == expected
    assert llm.engine.kv_cache.data.dtype == expected
    assert next(llm.engine.model.parameters()).dtype == expected
    assert f"--dtype auto: {str(expected).removeprefix('torch.')} on CPU, because" in caplog.text


@pytest.mark.parametrize(
    ("flags", "device", "expected"),
    [
        (ZEN3, "cpu", (torch.float32, torch.bfloat16)),  # no native bf16: bf16 weights, fp32 arithmetic
        (SKYLAKE_X, "cpu", (torch.float32, torch.bfloat16)),
        (SAPPHIRE_RAPIDS, "cpu", (torch.bfloat16, torch.bfloat16)),
        (COOPER_LAKE, "cpu", (torch.bfloat16, torch.bfloat16)),
        (ZEN3, "cuda", (torch.bfloat16, torch.bfloat16)),  # (the CPU does not matter on a GPU)
    ],
)
def test_bf16_precision_by_cpu(monkeypatch, flags, device, expected):
    monkeypatch.setattr(precision, "detect", lambda: caps_from_flags(flags, "AVX512"))
    resolved = precision.resolve_precision("bfloat16", torch.device(device))
    assert (resolved.compute, resolved.weights) == expected
    assert precision.resolve_precision("float32", torch.device(device)) == precision.Precision(
        torch.float32, torch.float32
    )


def test_bf16_without_native_bf16_is_bf16_weights_and_cache_in_fp32_arithmetic(
    monkeypatch, caplog, sharp_tiny_model_dir, bf16_sharp_tiny_model_dir
):
    """`--dtype bfloat16` on a CPU without native bf16: every weight rounded to bf16 (the linear ones
    held in bf16), a bf16 KV cache, fp32 activations: the same tokens and logprobs as an fp32 engine
    over the model's weights rounded to bf16 with a bf16 cache."""
    from tests.conftest import mixed_prompts
    from tokenmill import LLM, SamplingParams

    monkeypatch.setattr(precision, "detect", lambda: caps_from_flags(ZEN3, "AVX2"))
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.precision"):
        llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="16MiB", dtype="bfloat16")
    assert "--dtype bfloat16: weights and KV cache in bf16, arithmetic in fp32" in caplog.text
    engine = llm.engine
    assert (engine.dtype, engine.kv_dtype, engine.kv_cache.data.dtype) == (
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
    )
    assert engine.precision.describe() == "bfloat16 weights, float32 arithmetic"
    for name, parameter in engine.model.named_parameters():
        assert parameter.dtype == torch.float32
        assert torch.equal(parameter, parameter.bfloat16().float()), name
    reference = LLM(
        str(bf16_sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="16MiB",
        dtype="float32",
        kv_cache_dtype="bfloat16",
    )
    prompts = mixed_prompts(4, 1, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in engine_llm.generate(prompts, params)]
        for engine_llm in (llm, reference)
    ]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bf16_logits_are_the_heads_fp32_sums(sharp_tiny_model_dir, quantization):
    """`--dtype bfloat16` on CPU (and with int8 weights): the logits are the head's fp32 sums, not
    rounded to bf16 first (bf16 logits tie and swap near-equal tokens), whatever the CPU computes the
    model in (a bf16 head that oneDNN would compute without AMX tiles, which rounds its output, runs
    on the panel GEMM instead)."""
    from safetensors.torch import load_file

    from tokenmill import LLM

    llm = LLM(
        str(sharp_tiny_model_dir), progress=False, kv_cache_memory="16MiB", dtype="bfloat16", quantization=quantization
    )
    model = llm.engine.model
    head = model.lm_head
    weights = load_file(str(next(sharp_tiny_model_dir.glob("*.safetensors"))))
    weight = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight")).bfloat16().double()
    if quantization:
        weight = head.dequantized(torch.float64)
    hidden = torch.randn(9, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(llm.engine.dtype)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    tolerance = 1e-3 if quantization else 1e-4  # (int8's panels take x rounded to int16 per group of 32)
    torch.testing.assert_close(logits.double(), hidden.double() @ weight.T, rtol=tolerance, atol=tolerance)
    if not (head.quant_method.name == "onednn" and not head.amx_decode):
        assert (logits != logits.bfloat16().float()).any()
