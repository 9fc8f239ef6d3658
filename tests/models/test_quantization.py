"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) and `--quantization int4`: each format
loads from its config.json alone and gives the greedy tokens of a float model carrying the weights
the checkpoint encodes (transformers, fp32); unsupported methods and corrupt tensors are refused at
startup, naming them.

The fixtures are the sharp tiny Llama's weights quantized here and written as each format's
published layout specifies (GPTQ: AutoGPTQ's qweight/qzeros/scales/g_idx, v1 zero points less one
and gptqmodel's v2; AWQ: the GEMM packing's column order; compressed-tensors: pack-quantized words
offset by 2^(bits-1), int-quantized, float-quantized), with the reference weights computed from the
same integers by the formats' dequantization formulas."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_forward, hf_greedy, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned values packed into int32 words along `dim` (value j of a word at bits * j; AWQ: the
    word's value j is column order[j] of its 8)."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per_word)
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., j] << (bits * j) for j in range(per_word))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _groups_of(k: int, group_size: int, perm: torch.Tensor | None) -> torch.Tensor:
    """Each input's group: consecutive inputs, or (act order) by their place in `perm`."""
    size = k if group_size == -1 else group_size
    order = torch.arange(k) if perm is None else torch.argsort(perm)
    return order // size


def _int_quantize(w: torch.Tensor, bits: int, group: torch.Tensor, groups: int, symmetric: bool):
    """(q [N, K] unsigned, zeros [N, G], scales [N, G] fp16) of w [N, K] in the given groups."""
    top = (1 << bits) - 1
    n = w.shape[0]
    lo = torch.full((n, groups), float("inf")).scatter_reduce(1, group.expand(n, -1), w, "amin")
    hi = torch.full((n, groups), float("-inf")).scatter_reduce(1, group.expand(n, -1), w, "amax")
    if symmetric:
        scales = (torch.maximum(hi.abs(), lo.abs()) / (top // 2)).clamp(min=1e-6).half()
        zeros = torch.full((n, groups), (top + 1) // 2)
    else:
        scales = ((hi - lo) / top).clamp(min=1e-6).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, top)
    q = torch.round(w / scales.float()[:, group] + zeros[:, group]).clamp(0, top)
    return q.to(torch.int64), zeros.to(torch.int64), scales


def _write(source: Path, target: Path, config_update: dict, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config.update(config_update)
    (target / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _quantized_pair(source: Path, tmp: Path, name: str, quantization_config: dict, encode) -> tuple[Path, Path]:
    """(the checkpoint in a format, the float reference) from `encode(module, weight) -> (tensors, the
    weight they encode)` applied to every projection (written once per name)."""
    if (tmp / f"{name}-reference").exists():
        return tmp / name, tmp / f"{name}-reference"
    state = load_file(str(next(source.glob("*.safetensors"))))
    quantized, reference = {}, {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS:
            tensors, dequantized = encode(module, tensor.float())
            quantized.update({f"{module}.{k}": v for k, v in tensors.items()})
            reference[key] = dequantized.float()
        else:
            quantized[key] = reference[key] = tensor
    checkpoint = _write(source, tmp / name, {"quantization_config": quantization_config}, quantized)
    return checkpoint, _write(source, tmp / f"{name}-reference", {}, reference)


def gptq(bits: int, group_size: int, symmetric: bool, v2: bool, act_order: bool):
    def encode(module: str, w: torch.Tensor):
        n, k = w.shape
        groups = 1 if group_size == -1 else k // group_size
        # (one permutation per input size: the parts of a fused layer share their inputs, so their g_idx)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act_order else None
        group = _groups_of(k, group_size, perm)
        q, zeros, scales = _int_quantize(w, bits, group, groups, symmetric)
        stored_zeros = zeros if v2 else (zeros - 1) & ((1 << bits) - 1)
        tensors = {
            "qweight": _pack(q.t(), bits, dim=0),
            "qzeros": _pack(stored_zeros.t(), bits, dim=1),
            "scales": scales.t().contiguous(),
            "g_idx": group.to(torch.int32),
        }
        return tensors, (q - zeros[:, group]).float() * scales.float()[:, group]

    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "sym": symmetric,
        "desc_act": act_order,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    return config, encode


def awq(group_size: int):
    def encode(module: str, w: torch.Tensor):
        n, k = w.shape
        group = _groups_of(k, group_size, None)
        q, zeros, scales = _int_quantize(w, 4, group, k // group_size, symmetric=False)
        tensors = {
            "qweight": _pack(q.t(), 4, dim=1, order=AWQ_ORDER),
            "qzeros": _pack(zeros.t(), 4, dim=1, order=AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }
        return tensors, (q - zeros[:, group]).float() * scales.float()[:, group]

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return config, encode


def _ct_config(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
    }


def ct_packed(bits: int, group_size: int | None, scale_dtype: torch.dtype):
    def encode(module: str, w: torch.Tensor):
        n, k = w.shape
        size = group_size or k
        group = _groups_of(k, size, None)
        q, zeros, scales = _int_quantize(w, bits, group, k // size, symmetric=True)
        scales = scales.to(scale_dtype)
        signed = q - zeros[:, group]  # (-2^(bits-1) .. 2^(bits-1) - 1)
        tensors = {
            "weight_packed": _pack(signed + (1 << (bits - 1)), bits, dim=1),
            "weight_scale": scales,
            "weight_shape": torch.tensor([n, k]),
        }
        return tensors, signed.float() * scales.float()[:, group]

    strategy = {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    weights = {"num_bits": bits, "type": "int", "symmetric": True, **strategy}
    return _ct_config("pack-quantized", weights), encode


def ct_w8a8():
    def encode(module: str, w: torch.Tensor):
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / scale).clamp(-127, 127)
        return {"weight": q.to(torch.int8), "weight_scale": scale}, q * scale

    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return _ct_config("int-quantized", weights, activations), encode


def fp8(block: bool, transformers_fp8: bool = False):
    def encode(module: str, w: torch.Tensor):
        if block:
            n, k = w.shape
            blocks = w[: n // 128 * 128].reshape(n // 128, 128, k // 128, 128) if n % 128 == 0 else None
            assert blocks is not None and k % 128 == 0
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        else:
            scale = expanded = w.abs().amax(dim=1, keepdim=True) / 448
        q = (w / expanded).to(torch.float8_e4m3fn)
        name = "weight_scale_inv" if transformers_fp8 else "weight_scale"
        return {"weight": q, name: scale}, q.float() * expanded

    if transformers_fp8:
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        return config, encode
    strategy = {"strategy": "block", "block_structure": [128, 128]} if block else {"strategy": "channel"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, **strategy}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    return _ct_config("float-quantized", weights, activations), encode


FORMATS = {
    "gptq-4bit-g32-sym-v1": gptq(4, 32, True, False, False),
    "gptq-4bit-g128-asym-v2": gptq(4, 128, False, True, False),
    "gptq-4bit-g64-act-order": gptq(4, 64, True, False, True),
    "gptq-4bit-channel": gptq(4, -1, True, False, False),
    "gptq-8bit-g128-sym": gptq(8, 128, True, False, False),
    "gptq-8bit-g32-asym-v2": gptq(8, 32, False, True, False),
    "awq-4bit-g64": awq(64),
    "ct-w4a16-g32-bf16-scales": ct_packed(4, 32, torch.bfloat16),
    "ct-w8a16-channel": ct_packed(8, None, torch.float16),
    "ct-w8a8-dynamic-tokens": ct_w8a8(),
    "ct-fp8-channel": fp8(block=False),
    "ct-fp8-block": fp8(block=True),
    "transformers-fp8-block": fp8(block=True, transformers_fp8=True),
}


@pytest.fixture(scope="module")
def formats_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantized")


# The integer kernels round each block of activations to int16 (under 1/65534 of its largest value),
# which moves the sharp tiny model's log-probabilities by up to ~2e-3 from fp32's (the float path's:
# ~1e-5); its greedy tokens may then part from the reference's at a near tie.
INT16_ACTIVATIONS_TOLERANCE = 5e-3


def assert_greedy_matches(llm, reference: Path, prompts: list[list[int]], max_tokens: int) -> None:
    """The engine's greedy tokens are the reference model's (transformers, fp32, teacher-forced on
    them), each log-probability within INT16_ACTIVATIONS_TOLERANCE of the reference's; a sequence may
    part only where the reference's top two were that close (once in all the prompts)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    parted = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        completion = out.outputs[0]
        expected, _ = hf_forward(reference, prompt + completion.token_ids[:-1])
        for t, token in enumerate(completion.token_ids):
            step = expected[len(prompt) - 1 + t]
            top = int(step.argmax())
            if token != top:
                assert step[top] - step[token] < INT16_ACTIVATIONS_TOLERANCE, (prompt, t, token, top)
                parted += 1
                break
            assert abs(completion.logprobs[t][0] - step[token].item()) < INT16_ACTIVATIONS_TOLERANCE, (prompt, t)
    assert parted <= 1, parted


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "ct-w8a8-dynamic-tokens"])
def test_format_loads_and_matches_its_dequantized_reference(fmt, sharp_tiny_model_dir, formats_dir):
    config, encode = FORMATS[fmt]
    torch.manual_seed(0)
    checkpoint, reference = _quantized_pair(sharp_tiny_model_dir, formats_dir, fmt, config, encode)
    llm = LLM(str(checkpoint), progress=False, kv_cache_memory="32MiB", dtype="float32")
    assert_greedy_matches(llm, reference, mixed_prompts(4, 3, 40, seed=21), max_tokens=8)
    methods = {layer.quant_method.name for layer in _linear_layers(llm) if layer is not llm.engine.model.lm_head}
    assert methods and "float" not in methods and "panels" not in methods, methods


def test_w8a8_rounds_each_tokens_activations_as_the_scheme_does(sharp_tiny_model_dir, formats_dir):
    """W8A8 (int8 weights, dynamic per-token int8 activations): teacher-forced log-probabilities of the
    float reference whose projections take their inputs rounded per token. (Not greedy equality: an
    activation a hair from a rounding boundary in either model moves by 1/127 of its token's largest,
    enough to swap near-tied tokens.)"""
    from transformers import AutoModelForCausalLM

    from tokenmill.models.layers.quantization.formats import quantize_tokens

    config, encode = FORMATS["ct-w8a8-dynamic-tokens"]
    checkpoint, reference = _quantized_pair(sharp_tiny_model_dir, formats_dir, "ct-w8a8", config, encode)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.register_forward_pre_hook(lambda _, args: (quantize_tokens(args[0]),))
    llm = LLM(str(checkpoint), progress=False, kv_cache_memory="32MiB", dtype="float32")
    unrounded = LLM(str(reference), progress=False, kv_cache_memory="32MiB", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    total = float_total = 0.0
    for prompt in mixed_prompts(3, 30, 40, seed=4):
        with torch.inference_mode():
            expected = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        got, float_run = (e.generate([prompt], params)[0].prompt_logprobs for e in (llm, unrounded))
        gaps = [abs(got[t][prompt[t]].logprob - expected[t - 1, prompt[t]].item()) for t in range(1, len(prompt))]
        float_gaps = [
            abs(float_run[t][prompt[t]].logprob - expected[t - 1, prompt[t]].item()) for t in range(1, len(prompt))
        ]
        total += sum(gaps)
        float_total += sum(float_gaps)
    # One activation on a rounding boundary (where the reference's own float summation order decides
    # it) changes that token's keys and values, and so every later position a little: the bound is on
    # the whole, against the unrounded run's distance from the same reference.
    assert total < float_total / 2, (total, float_total)


def _linear_layers(llm):
    from tokenmill.models.layers.linear import linear_layers

    return [layer for _, layer in linear_layers(llm.engine.model)]


def _native_bf16() -> bool:
    from tokenmill.kernels.cpu_caps import detect

    return detect().native_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("fmt", "method"),
    [
        ("gptq-4bit-g128-asym-v2", "int4"),
        ("ct-w8a8-dynamic-tokens", "w8a8"),
        ("ct-fp8-channel", "fp8"),
        ("ct-fp8-block", "fp8"),
    ],
)
def test_quantized_checkpoints_fuse_bit_identically(fmt, method, dtype, sharp_tiny_model_dir, formats_dir):
    """4-bit, W8A8 (activations rounded to int8 per token) and FP8 (per channel, 128 x 128 blocks)
    layers on their kernels fuse into the native decoder stack, with the same tokens, logprobs and
    cache bytes as the Python layers: decodes of a few sequences in the one parallel region (each
    thread rounding a W8A8 layer's rows itself), prompt chunks with cached context layer by layer
    (chunks of up to 32 tokens), in fp32 and (a CPU with native bf16) bf16 activations."""
    from tokenmill.kernels import build

    if not build.load():
        pytest.skip("tokenmill's CPU kernels are not built here")
    if dtype == "bfloat16" and not _native_bf16():
        pytest.skip("bf16 activations need a CPU with native bf16 (AMX or AVX512-BF16)")
    config, encode = FORMATS[fmt]
    torch.manual_seed(0)
    checkpoint, _ = _quantized_pair(sharp_tiny_model_dir, formats_dir, fmt, config, encode)
    engines = [
        LLM(str(checkpoint), progress=False, kv_cache_memory="32MiB", dtype=dtype, max_num_batched_tokens=32, **flags)
        for flags in ({}, {"fused_layers": False})
    ]
    fused, plain = (llm.engine.model for llm in engines)
    assert {fused.layers[0].self_attn.qkv_proj.quant_method.name, fused.layers[0].mlp.down_proj.quant_method.name} == {
        method
    }
    assert fused.fused_stack is not None and all(layer.fused is not None for layer in fused.layers)
    assert plain.fused_stack is None
    prompts = mixed_prompts(3, 3, 70, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    outs = [[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)] for llm in engines]
    assert outs[0] == outs[1]
    assert fused.fused_stack.native.region_steps() >= params.max_tokens - 1  # the decodes, in the one region
    assert torch.equal(engines[0].engine.kv_cache.data, engines[1].engine.kv_cache.data)


@pytest.mark.parametrize(
    ("fmt", "method"),
    [
        ("gptq-8bit-g128-sym", "int8"),
        ("ct-w8a16-channel", "int8"),
        ("ct-w8a8-dynamic-tokens", "w8a8"),
        ("ct-fp8-channel", "fp8"),
        ("ct-fp8-block", "fp8"),
        ("transformers-fp8-block", "fp8"),
    ],
)
def test_eight_bit_checkpoints_run_on_the_kernels_from_their_own_values(fmt, method, sharp_tiny_model_dir, formats_dir):
    """8-bit layers (int8 and FP8) hold the checkpoint's bytes and scales as they are (no float copy,
    nothing quantized again): the layer's weight is the checkpoint's values times its scales, exactly."""
    from tokenmill.kernels import build

    if not build.load():
        pytest.skip("tokenmill's CPU kernels are not built here")
    config, encode = FORMATS[fmt]
    torch.manual_seed(0)
    checkpoint, reference = _quantized_pair(sharp_tiny_model_dir, formats_dir, fmt, config, encode)
    llm = LLM(str(checkpoint), progress=False, kv_cache_memory="32MiB", dtype="float32")
    layer = llm.engine.model.layers[1].mlp.down_proj
    assert layer.quant_method.name == method
    assert layer.quant_method.streamed_tensors(layer)[0].element_size() == 1
    assert not any(p.is_floating_point() and p.dim() == 2 for p in layer.parameters())
    expected = load_file(str(reference / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer.dequantized(torch.float32), expected)


def test_int4_of_a_float_checkpoint_matches_its_dequantized_weights(sharp_tiny_model_dir, tmp_path):
    """`--quantization int4`: the tokens of a float model carrying the weights the layers hold (the
    4-bit layers' and the int8 head's, which the tied embedding reads too)."""
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="32MiB", dtype="float32", quantization="int4")
    model = llm.engine.model
    assert model.layers[0].mlp.down_proj.quant_method.name == "int4"
    state = load_file(str(next(sharp_tiny_model_dir.glob("*.safetensors"))))
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    reference = dict(state)
    for i, layer in enumerate(model.layers):
        for owner, linear in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for attr, part_names in list(parts.items()) + [("o_proj", ("o_proj",)), ("down_proj", ("down_proj",))]:
                if not hasattr(linear, attr):
                    continue
                weight = getattr(linear, attr).dequantized(torch.float32)
                sizes = [state[f"model.layers.{i}.{owner}.{p}.weight"].shape[0] for p in part_names]
                for p, piece in zip(part_names, weight.split(sizes)):
                    reference[f"model.layers.{i}.{owner}.{p}.weight"] = piece.contiguous()
    reference["model.embed_tokens.weight"] = model.lm_head.dequantized(torch.float32)
    target = _write(sharp_tiny_model_dir, tmp_path / "int4-reference", {}, reference)
    prompts = mixed_prompts(4, 3, 40, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(target, p, params.max_tokens) for p in prompts]


# --- refused at startup ---------------------------------------------------------------------------


def _with_config(source: Path, target: Path, quantization_config: dict) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("method", "config"),
    [
        ("bitsandbytes", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
        ("exl2", {"quant_method": "exl2", "bits": 4.0}),
        ("hqq", {"quant_method": "hqq"}),
    ],
)
def test_unsupported_methods_are_refused_naming_them(method, config, sharp_tiny_model_dir, tmp_path):
    model_dir = _with_config(sharp_tiny_model_dir, tmp_path / method, config)
    with pytest.raises(ModelLoadError, match=f"quantization method '{method}' is not supported"):
        LLM(str(model_dir), progress=False, kv_cache_memory="16MiB")


def test_quantizing_a_quantized_checkpoint_again_is_refused(sharp_tiny_model_dir, formats_dir):
    config, encode = FORMATS["awq-4bit-g64"]
    checkpoint, _ = _quantized_pair(sharp_tiny_model_dir, formats_dir, "awq-again", config, encode)
    with pytest.raises(ModelLoadError, match="already quantized"):
        LLM(str(checkpoint), progress=False, kv_cache_memory="16MiB", quantization="int4")


@pytest.fixture(scope="module")
def gptq_checkpoint(sharp_tiny_model_dir, formats_dir) -> Path:
    config, encode = FORMATS["gptq-4bit-g32-sym-v1"]
    return _quantized_pair(sharp_tiny_model_dir, formats_dir, "gptq-corrupt-source", config, encode)[0]


def _corrupt(source: Path, target: Path, change) -> Path:
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    state = load_file(str(path))
    change(state)
    save_file(state, str(path), metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("wrong shape", r"o_proj\.qweight has shape"),
        ("parts that do not join", r"qkv_proj\.qweight: the checkpoint's parts"),
        ("missing scales", r"missing from the checkpoint: .*qkv_proj\.scales"),
        ("float qweight", r"q_proj\.qweight has dtype torch\.float32"),
        ("g_idx out of range", r"qkv_proj\.g_idx: group indices outside"),
        ("unsupported bits", "GPTQ with 3 bits is not supported"),
    ],
)
def test_corrupt_or_mismatched_tensors_are_refused_naming_them(case, match, gptq_checkpoint, tmp_path):
    checkpoint = gptq_checkpoint
    prefix = "model.layers.0.self_attn.q_proj"

    def change(state: dict) -> None:
        if case == "wrong shape":
            o_proj = "model.layers.0.self_attn.o_proj.qweight"
            state[o_proj] = state[o_proj][:-1].contiguous()
        elif case == "parts that do not join":
            state[f"{prefix}.qweight"] = state[f"{prefix}.qweight"][:-1].contiguous()
        elif case == "missing scales":
            del state[f"{prefix}.scales"]
        elif case == "float qweight":
            state[f"{prefix}.qweight"] = state[f"{prefix}.qweight"].float()
        elif case == "g_idx out of range":
            for part in ("q_proj", "k_proj", "v_proj"):
                state[f"model.layers.0.self_attn.{part}.g_idx"][3] = 1000

    model_dir = _corrupt(checkpoint, tmp_path / "corrupt", change)
    if case == "unsupported bits":
        config_path = model_dir / "config.json"
        raw = json.loads(config_path.read_text())
        raw["quantization_config"]["bits"] = 3
        config_path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(model_dir), progress=False, kv_cache_memory="16MiB")


def test_fp8_weights_holding_nan_are_refused_naming_them(sharp_tiny_model_dir, formats_dir, tmp_path):
    """e4m3's NaN byte would be read as a number by the FP8 kernel: such a checkpoint is refused."""
    from tokenmill.kernels import build

    if not build.load():
        pytest.skip("tokenmill's CPU kernels are not built here")
    config, encode = FORMATS["ct-fp8-channel"]
    checkpoint, _ = _quantized_pair(sharp_tiny_model_dir, formats_dir, "ct-fp8-channel", config, encode)

    def change(state: dict) -> None:
        weight = state["model.layers.1.mlp.down_proj.weight"]
        weight.view(torch.uint8)[3, 5] = 0x7F

    model_dir = _corrupt(checkpoint, tmp_path / "nan", change)
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight: holds NaN"):
        LLM(str(model_dir), progress=False, kv_cache_memory="16MiB")


# --- checkpoints written by compressed-tensors itself ---------------------------------------------


@pytest.fixture(scope="module")
def write_compressed():
    """bench/eight_bit_checkpoints.py's writer: a float checkpoint quantized and saved by the
    compressed-tensors library (its schemes, qparams and compressors), as llm-compressor exports."""
    import importlib.util

    pytest.importorskip("compressed_tensors")
    path = Path(__file__).resolve().parents[2] / "bench" / "eight_bit_checkpoints.py"
    spec = importlib.util.spec_from_file_location("eight_bit_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_compressed


@pytest.mark.parametrize(("scheme", "method"), [("W8A16", "int8"), ("W8A8", "w8a8"), ("FP8_DYNAMIC", "fp8")])
def test_compressed_tensors_exports_hold_what_the_library_decompresses(
    scheme, method, write_compressed, sharp_tiny_model_dir, tmp_path
):
    """A checkpoint the library wrote loads on the kernels, each layer's weight the library's own
    decompression of it (which computes value * scale in the scale's dtype, bf16: the layers hold
    the exact fp32 product, equal to it once rounded to bf16)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from tokenmill.kernels import build

    if not build.load():
        pytest.skip("tokenmill's CPU kernels are not built here")
    checkpoint = write_compressed(sharp_tiny_model_dir, tmp_path / scheme, scheme)
    decompressed = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    llm = LLM(str(checkpoint), progress=False, kv_cache_memory="32MiB", dtype="float32")
    for i, layer in enumerate(llm.engine.model.layers):
        expected = decompressed.model.layers[i]
        ours = layer.self_attn.qkv_proj.dequantized(torch.float32).bfloat16()
        parts = [expected.self_attn.q_proj, expected.self_attn.k_proj, expected.self_attn.v_proj]
        assert torch.equal(ours, torch.cat([p.weight for p in parts]).bfloat16())
        assert layer.mlp.down_proj.quant_method.name == method
        assert torch.equal(
            layer.mlp.down_proj.dequantized(torch.float32).bfloat16(), expected.mlp.down_proj.weight.bfloat16()
        )
    prompt = mixed_prompts(1, 20, 20, seed=3)[0]
    assert len(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].token_ids) == 4
