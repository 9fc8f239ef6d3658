"""The one-call decoder layer (`--fused-layers`, tokenmill.models.layers.fused_layer): bit-identical to
the Python layer it replaces, used where it applies, standing aside where it does not."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import mixed_prompts, run_staggered
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import build
from tokenmill.kernels.cpu_caps import detect
from tokenmill.models.layers.fused_layer import FusedLayer, FusedStack

pytestmark = pytest.mark.skipif(not build.load(), reason="tokenmill's CPU kernels are not built here")


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts the fused layer calls (one entry per call, the step's token count)."""
    calls: list[int] = []
    original, original_stack = FusedLayer.__call__, FusedStack.__call__

    def counting(self, x, *args):
        calls.append(x.shape[0])
        return original(self, x, *args)

    def counting_stack(self, x, *args):
        calls.extend([x.shape[0]] * len(self.layers))
        return original_stack(self, x, *args)

    monkeypatch.setattr(FusedLayer, "__call__", counting)
    monkeypatch.setattr(FusedStack, "__call__", counting_stack)
    return calls


def _engine(model_dir, **args) -> LLM:
    return LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=32, **args)


@pytest.mark.parametrize(
    ("model", "quantization"),
    [
        ("sharp_tiny_model_dir", None),
        ("tiny_qwen2_dir", None),
        ("tiny_mistral_dir", None),
        ("sharp_tiny_model_dir", "int8"),
        ("tiny_qwen2_dir", "int8"),
    ],
)
def test_fused_layers_are_bit_identical_to_the_python_layers(model, quantization, request, fused_calls):
    """Llama, Qwen2 (qkv bias) and Mistral (sliding window, prompts past it), fp32 and int8 weights:
    the same tokens and the same logprobs to the last bit, batches joining mid-decode, chunked
    prefill (chunks with cached context take the fused path too)."""
    model_dir = request.getfixturevalue(model)
    prompts = mixed_prompts(6, 1, 70, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    fused = _engine(model_dir, quantization=quantization)
    plain = _engine(model_dir, quantization=quantization, fused_layers=False)
    layers = fused.engine.model.layers
    assert all(layer.fused is not None for layer in layers)
    assert fused.engine.model.fused_stack is not None  # every layer fused: one loop of C++ calls per step
    assert all(layer.fused is None for layer in plain.engine.model.layers)
    assert plain.engine.model.fused_stack is None
    outs = {}
    for name, llm in (("fused", fused), ("plain", plain)):
        outs[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert outs["fused"] == outs["plain"]
    assert len(fused_calls) >= len(layers) * params.max_tokens  # decode steps (and context chunks) ran fused
    assert max(fused_calls) > 1  # batched steps too
    staggered = SamplingParams(temperature=0.0, max_tokens=8)
    assert run_staggered(fused, prompts, staggered) == run_staggered(plain, prompts, staggered)


def _native_bf16() -> bool:
    return detect().native_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bf16_method(batch_invariant: bool | None = None) -> str:
    """The method a bf16 model's layers get here (batch_invariant: as asked, None: by default)."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.setup import batch_invariance
    from tokenmill.models.layers.packed_linear import packed_method_for

    invariant = batch_invariance(EngineConfig(batch_invariant=batch_invariant), torch.device("cpu"), torch.bfloat16)
    method = packed_method_for(torch.bfloat16, invariant)
    assert method is not None
    return method.name


def _bf16_projections_in_region() -> bool:
    """Whether a bf16 model's projections (by default) are ones the one-region stack computes: bf16
    or pair panels, or oneDNN weights on amx_linear's tiles (AMX)."""
    return _bf16_method() != "onednn" or torch.ops.tokenmill.amx_bf16_usable()


@pytest.mark.skipif(
    not _native_bf16(), reason="bf16 activations on oneDNN need a CPU with native bf16 (AMX or AVX512-BF16)"
)
@pytest.mark.parametrize("batch_invariant", [True, False])
@pytest.mark.parametrize(("cache_dtype", "quantization"), [("auto", None), ("int8", None), ("auto", "int8")])
def test_bf16_layers_fuse_bit_identically(
    sharp_tiny_model_dir, cache_dtype, quantization, batch_invariant, fused_calls
):
    """`--dtype bfloat16` where the CPU has native bf16: bf16 activations, the projections on this
    CPU's bf16 method (oneDNN, or with batch invariance the panels or pair panels where oneDNN has
    no AMX) or int8 panels, the layers fused into the native stack, with the same tokens, logprobs
    and cache bytes as the Python layers (whose norms, RoPE and SiLU*up run as the same bf16 kernels)."""
    prompts = mixed_prompts(20, 1, 60, seed=13)  # (20 decodes a step: int8 steps of 16 rows and more on AMX tiles)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
    flags = dict(
        dtype="bfloat16", kv_cache_dtype=cache_dtype, quantization=quantization, batch_invariant=batch_invariant
    )
    fused = _engine(sharp_tiny_model_dir, **flags)
    plain = _engine(sharp_tiny_model_dir, fused_layers=False, **flags)
    model = fused.engine.model
    projection = "int8" if quantization else _bf16_method(batch_invariant)
    assert fused.engine.dtype == torch.bfloat16 and model.layers[0].mlp.down_proj.quant_method.name == projection
    assert model.fused_stack is not None and plain.engine.model.fused_stack is None
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (fused, plain)
    ]
    assert outs[0] == outs[1]
    assert len(fused_calls) >= len(model.layers) * params.max_tokens and max(fused_calls) > 1
    assert torch.equal(fused.engine.kv_cache.data, plain.engine.kv_cache.data)


@pytest.mark.parametrize(("cache_dtype", "quantization"), [("bfloat16", None), ("int8", None), ("int8", "int8")])
def test_fused_layers_write_a_narrow_cache_as_the_python_layers_do(
    sharp_tiny_model_dir, cache_dtype, quantization, fused_calls
):
    """K/V rows rounded into a bf16 cache, or quantized into an int8 one (values and their scale), by
    the fused layers' own code, bit for bit as the Python layers' index_copy_ of kv_quant.to_cache:
    the same tokens and logprobs, and the same cache bytes."""
    prompts = mixed_prompts(4, 1, 50, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    fused = _engine(sharp_tiny_model_dir, kv_cache_dtype=cache_dtype, quantization=quantization)
    plain = _engine(sharp_tiny_model_dir, kv_cache_dtype=cache_dtype, quantization=quantization, fused_layers=False)
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (fused, plain)
    ]
    assert outs[0] == outs[1] and fused_calls
    assert torch.equal(fused.engine.kv_cache.data, plain.engine.kv_cache.data)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_fully_fused_model_runs_its_layers_as_one_native_loop(sharp_tiny_model_dir, quantization, monkeypatch):
    """FusedStack: every decode step's layers in one C++ call (no per-layer Python), the same tokens
    and logprobs to the last bit as the per-layer fused calls."""
    counts = {"layer": 0, "stack": 0}
    for cls, key in ((FusedLayer, "layer"), (FusedStack, "stack")):

        def counting(self, *args, _original=cls.__call__, _key=key):
            counts[_key] += 1
            return _original(self, *args)

        monkeypatch.setattr(cls, "__call__", counting)
    prompts = mixed_prompts(4, 1, 40, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    stacked, per_layer = (
        _engine(sharp_tiny_model_dir, quantization=quantization),
        _engine(sharp_tiny_model_dir, quantization=quantization),
    )
    per_layer.engine.model.fused_stack = None
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (stacked, per_layer)
    ]
    assert outs[0] == outs[1]
    layers = len(per_layer.engine.model.layers)
    assert counts["stack"] > 0 and counts["layer"] == counts["stack"] * layers  # the stack's steps, per layer


@pytest.mark.parametrize("sequences", [1, 3])
@pytest.mark.parametrize(
    ("model", "quantization", "cache_dtype", "dtype"),
    [
        ("sharp_tiny_model_dir", None, "auto", "float32"),
        ("sharp_tiny_model_dir", "int8", "auto", "float32"),
        ("sharp_tiny_model_dir", None, "bfloat16", "float32"),
        ("sharp_tiny_model_dir", "int8", "int8", "float32"),
        ("tiny_qwen2_dir", "int8", "auto", "float32"),
        ("tiny_qwen2_window_dir", None, "auto", "float32"),
        ("tiny_mistral_dir", None, "auto", "float32"),
        ("sharp_tiny_model_dir", None, "auto", "bfloat16"),
        ("sharp_tiny_model_dir", "int8", "auto", "bfloat16"),
        ("tiny_qwen2_dir", None, "int8", "bfloat16"),
        ("tiny_qwen2_window_dir", "int8", "auto", "bfloat16"),
    ],
)
def test_small_steps_run_every_layer_in_one_parallel_region(
    model, quantization, cache_dtype, dtype, sequences, request
):
    """Decode steps of one or a few sequences (up to 6 tokens) take FusedStack's one-region path,
    the threads sharing each GEMM's panels, the RoPE and cache writes by token and head and the
    attention's items: the same tokens, logprobs and cache bytes to the last bit as the Python
    layers. Contexts past one 128-key chunk (attention items split and merged), qkv bias (Qwen2), a
    window on every layer (Mistral) or on some (Qwen2: one attention plan per window), fp32/bf16/int8
    caches, fp32 and int8 weights. bf16 activations (`--dtype bfloat16`, a CPU with native bf16): bf16
    rows between the ops as the layer path's tensors, the projections on AMX tiles (a oneDNN weight's
    32-output blocks shared among the threads; CPUs with AMX) or int8 panels (each thread's columns
    rounded to bf16 once)."""
    _check_one_region(
        request.getfixturevalue(model),
        quantization,
        cache_dtype,
        dtype,
        sequences,
        dtype == "float32" or quantization is not None or _bf16_projections_in_region(),
    )


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("sequences", [20, 48])
def test_bf16_decode_batches_on_amx_tiles_run_in_one_region_up_to_64_rows(sharp_tiny_model_dir, cache_dtype, sequences):
    """A bf16 stack whose projections are all on amx_linear's tiles takes decode steps of up to 64
    tokens in the region (panels stop at 6): 20 or 48 sequences decoding (48: a last chunk of 16 rows
    after 32, its tiles reading the buffers' padding rows), the same bits as the Python layers (whose
    amx_linear pads its rows the same way). Without AMX the batches' steps stay layer by layer (and
    the last few sequences' steps on bf16 or pair panels in the region): the same bits all the same."""
    amx = torch.ops.tokenmill.amx_bf16_usable()
    _check_one_region(sharp_tiny_model_dir, None, cache_dtype, "bfloat16", sequences, True if amx else None)


@pytest.mark.skipif(
    not (_native_bf16() and torch.ops.tokenmill.bf16_pair_linear_supported()),
    reason="pair panels need AVX512-BF16 (and the kernels built for AVX-512)",
)
@pytest.mark.parametrize("sequences", [1, 3, 20])
def test_bf16_pair_panels_fuse_bit_identically(sharp_tiny_model_dir, monkeypatch, sequences):
    """The bf16 method of AMD CPUs with AVX512-BF16 under batch invariance (pair panels, bf16 dot
    products; forced here): the layers fused, small steps in the one region (each thread its share of
    the pair panels), the same tokens, logprobs and cache bytes as the Python layers."""
    import dataclasses

    from tokenmill.models.layers import packed_linear

    caps = dataclasses.replace(packed_linear.detect(), vendor="AuthenticAMD", amx_bf16=False)
    monkeypatch.setattr(packed_linear, "detect", lambda: caps)
    fused = _engine(sharp_tiny_model_dir, dtype="bfloat16", batch_invariant=True)
    plain = _engine(sharp_tiny_model_dir, dtype="bfloat16", batch_invariant=True, fused_layers=False)
    assert fused.engine.model.layers[0].mlp.down_proj.quant_method is packed_linear.PAIR_PANELS
    prompts = mixed_prompts(sequences, 130, 150, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (fused, plain)
    ]
    assert outs[0] == outs[1]
    if sequences <= 6:
        assert fused.engine.model.fused_stack.native.region_steps() >= params.max_tokens - 1
    assert torch.equal(fused.engine.kv_cache.data, plain.engine.kv_cache.data)


def _check_one_region(model_dir, quantization, cache_dtype, dtype, sequences, on_region: bool | None) -> None:
    """fused and Python layers: the same tokens, logprobs and cache bytes; every decode step of the
    fused engine in the one region (on_region), none of them (False), or either (None)."""
    if dtype == "bfloat16" and not _native_bf16():
        pytest.skip("bf16 activations need a CPU with native bf16 (AMX or AVX512-BF16)")
    prompts = mixed_prompts(sequences, 130, 150, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
    fused = _engine(model_dir, quantization=quantization, kv_cache_dtype=cache_dtype, dtype=dtype)
    plain = _engine(model_dir, quantization=quantization, kv_cache_dtype=cache_dtype, dtype=dtype, fused_layers=False)
    assert fused.engine.dtype == getattr(torch, dtype)
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (fused, plain)
    ]
    assert outs[0] == outs[1]
    regions = fused.engine.model.fused_stack.native.region_steps()
    if on_region:
        assert regions >= params.max_tokens - 1  # every decode step
    elif on_region is not None:
        assert regions == 0
    assert torch.equal(fused.engine.kv_cache.data, plain.engine.kv_cache.data)


def test_fused_layers_stand_aside_where_they_do_not_apply(sharp_tiny_model_dir, fused_calls):
    """--fused-layers off and projections LoRA wrapped after loading take the Python layer; so does a
    first prefill chunk on SDPA (--no-batch-invariant; with batch invariance it is on the paged kernel,
    and fused)."""
    prompt = mixed_prompts(1, 20, 20, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    _engine(sharp_tiny_model_dir, fused_layers=False).generate(prompt, params)
    lora = _engine(sharp_tiny_model_dir, enable_lora=True, max_loras=1)
    assert type(lora.engine.model.layers[0].self_attn.qkv_proj).__name__ == "LoRALinear"
    assert lora.engine.model.fused_stack is not None  # fused before the wrapping: it must stand aside itself
    lora.generate(prompt, params)
    assert fused_calls == []
    llm = _engine(sharp_tiny_model_dir, batch_invariant=False)
    llm.generate(prompt, params)
    layers = len(llm.engine.model.layers)
    assert fused_calls == [1] * layers * (params.max_tokens - 1)  # the decodes; not the 20-token first chunk
    fused_calls.clear()
    _engine(sharp_tiny_model_dir, batch_invariant=True).generate(prompt, params)
    assert fused_calls == [20] * layers + [1] * layers * (params.max_tokens - 1)


@pytest.mark.parametrize("family", ["qwen3", "gemma"])
def test_only_llama_shaped_layers_fuse(family, tmp_path, default_model_dir):
    """Qwen3's q/k norms and Gemma's (1 + w) norms and GELU keep the Python layer."""
    from tests.conftest import save_random_model
    from tests.models.test_native_families import CONFIGS

    model_dir = save_random_model(CONFIGS[family](), default_model_dir, tmp_path, seed=3)
    llm = _engine(model_dir)
    assert all(layer.fused is None for layer in llm.engine.model.layers)


def test_bf16_valued_weights_run_from_bf16_panels_bit_identically(bf16_sharp_tiny_model_dir, monkeypatch, fused_calls):
    """A model published in bf16, run in fp32: every projection (and the tied embedding) is held in
    bf16 panels, half the bytes, and the fused layers read them; tokens and logprobs equal those of
    the same engine on fp32 panels to the last bit, and the greedy tokens HF fp32 generate's."""
    from tests.conftest import hf_greedy
    from tokenmill.models.layers import packed_linear
    from tokenmill.models.layers.packed_linear import PanelEmbedding

    prompts = mixed_prompts(4, 1, 60, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
    narrow = _engine(bf16_sharp_tiny_model_dir, dtype="float32")
    panels = [m for m in narrow.engine.model.modules() if getattr(m, "quant_method", None) is packed_linear.PANELS]
    assert panels and all(m.packed_weight.dtype == torch.bfloat16 for m in panels)
    embedding = narrow.engine.model.embed_tokens
    assert isinstance(embedding, PanelEmbedding) and embedding.panels.dtype == torch.bfloat16
    assert embedding(torch.tensor([3, 77])).dtype == torch.float32
    assert all(layer.fused is not None for layer in narrow.engine.model.layers)
    monkeypatch.setattr(packed_linear, "panel_dtype", lambda weight: weight.dtype)
    wide = _engine(bf16_sharp_tiny_model_dir, dtype="float32")
    wide_panels = [m for m in wide.engine.model.modules() if getattr(m, "quant_method", None) is packed_linear.PANELS]
    assert all(m.packed_weight.dtype == torch.float32 for m in wide_panels)
    outs = [
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        for llm in (narrow, wide)
    ]
    assert outs[0] == outs[1]
    assert fused_calls
    assert [tokens for tokens, _ in outs[0]] == [
        hf_greedy(bf16_sharp_tiny_model_dir, p, params.max_tokens) for p in prompts
    ]


@pytest.mark.unit
def test_only_exact_bf16_values_go_to_bf16_panels():
    from tokenmill.models.layers.packed_linear import panel_dtype

    weight = torch.randn(8, 8)
    assert panel_dtype(weight) == torch.float32
    assert panel_dtype(weight.bfloat16().float()) == torch.bfloat16
    nudged = weight.bfloat16().float()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))  # one value a bf16 cannot hold
    assert panel_dtype(nudged) == torch.float32
    assert panel_dtype(weight.bfloat16()) == torch.bfloat16
