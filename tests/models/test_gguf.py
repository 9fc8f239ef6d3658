"""GGUF files as models (tokenmill/models/model_loader/gguf.py): every supported tensor type read as
transformers reads it, Q8_0 layers on the int8 kernels and Q4_0 / Q4_1 layers on the 4-bit kernels
with the file's own values and scales, the cached copy keyed by the file, and refusals by name.

The files are written by the `gguf` package's writer (tests/utils/gguf_files.py) from small random
models; the reference is transformers' own reading of the same file (its dequantization)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import sharpen_weights
from tests.utils.gguf_files import (
    CHAT_TEMPLATE,
    TINY_VOCAB_SIZE,
    hf_model_from_gguf,
    random_k_blocks,
    tiny_config,
    write_gguf,
)
from tokenmill.errors import ModelLoadError
from tokenmill.kernels import build
from tokenmill.models.model_loader import gguf as gguf_loader
from tokenmill.models.model_loader.gguf import ConvertedGGUF, dequantized_model_dir, gguf_model_dir

ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # (the linear layers' blocks run as they are)


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Converted copies go to a cache of the test session's own (never the developer's)."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Sharpened random HF models (tiny vocabulary), by architecture, built on first use."""
    from transformers import AutoModelForCausalLM

    built: dict[str, Path] = {}

    class Models(dict):
        def __missing__(self, arch: str) -> Path:
            torch.manual_seed(len(built))
            model = sharpen_weights(AutoModelForCausalLM.from_config(tiny_config(arch)), seed=len(built))
            target = tmp_path_factory.mktemp(f"hf-{arch}")
            model.save_pretrained(target)
            built[arch] = target
            return target

    return Models()


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory, hf_models) -> dict[tuple[str, str], Path]:
    """GGUF files by (architecture, tensor type), written on first use."""
    directory = tmp_path_factory.mktemp("gguf")

    class Files(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            arch, kind = key
            self[key] = write_gguf(hf_models[arch], directory / f"{arch}.{kind}.gguf", kind, seed=len(self))
            return self[key]

    return Files()


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A converted copy's tensors as values (a kept layer's blocks as the weight they encode)."""
    out = {name: tensor for name, tensor in tensors.items() if name.endswith((".weight", ".bias"))}
    for name in tensors:
        module, _, part = name.rpartition(".")
        if part == "qweight":
            parts = {
                p: tensors[f"{module}.{p}"].numpy()
                for p in ("qweight", "scales", "offsets")
                if f"{module}.{p}" in tensors
            }
            out[f"{module}.weight"] = torch.from_numpy(gguf_loader.blocks_dequantized(parts))
    return out


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_converts_to_transformers_values(gguf_files, kind):
    """Each type's tensors come out as transformers dequantizes the file: float types in their own
    dtype; the linear layers' Q8_0 / Q4_0 / Q4_1 blocks as their values and fp16 scales (exactly the
    blocks' numbers; the tied head given the embedding's blocks, the embedding dequantized); the
    K-quant types dequantized to fp32; with transformers' config and the tokenizer and chat template
    of the file's metadata."""
    from transformers import AutoTokenizer

    path = gguf_files["llama", kind]
    converted = gguf_model_dir(path)
    tensors = {}
    for shard in converted.glob("*.safetensors"):
        tensors.update(load_file(shard))
    reference = hf_model_from_gguf(path).state_dict()
    ours = _dequantized(tensors)
    kept = kind in KEPT_TYPES
    assert set(ours) == set(reference) - ({"lm_head.weight"} if not kept else set())  # (else tied: the embedding)
    for name, values in ours.items():
        assert torch.equal(values.float(), reference[name].float()), name
    floats = {t.dtype for name, t in tensors.items() if t.dim() == 2 and name.endswith(".weight")}
    expected = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    assert floats == {expected.get(kind, torch.float32)}
    config = json.loads((converted / "config.json").read_text())
    summary = ConvertedGGUF.read(converted)
    if kept:
        values = {t.dtype for name, t in tensors.items() if name.endswith(".qweight")}
        assert values == {torch.int8 if kind == "Q8_0" else torch.uint8}
        assert {t.dtype for name, t in tensors.items() if name.endswith((".scales", ".offsets"))} == {torch.float16}
        assert any(name.endswith(".offsets") for name in tensors) == (kind == "Q4_1")
        layers = config["quantization_config"]["layers"]
        assert set(layers) == {name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")}
        assert "lm_head" in layers and set(layers.values()) == {kind} and not config["tie_word_embeddings"]
        assert summary.kept == {kind: len(layers) - 1}  # (the head: the embedding's blocks)
        assert summary.dequantized == {kind: 1}  # (the embedding)
    else:
        assert "quantization_config" not in config and not summary.kept
        dequantized = {kind: summary.tensor_types[kind]} if kind not in expected else {}
        assert summary.tensor_types[kind] > 0 and summary.dequantized == dequantized
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.chat_template == CHAT_TEMPLATE and len(tokenizer) == TINY_VOCAB_SIZE
    file_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "the rain in spain <|im_end|>"
    assert tokenizer(text)["input_ids"] == file_tokenizer(text)["input_ids"]


PROMPTS = [[1, 40, 41, 42, 43], [5, 90, 100, 7], [200, 201, 13, 14, 15, 16, 17], [3, 4]]


def _hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=2, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def _tokenmill_greedy(path: Path, new_tokens: int, **engine_args):
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path), progress=False, dtype="float32", kv_cache_memory="16MiB", **engine_args)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("arch", "kind"),
    [("llama", "F32"), ("llama", "Q4_K"), ("llama", "Q6_K"), ("qwen2", "F32"), ("qwen3", "F16"), ("phi3", "BF16")]
    + [("gemma2", "F32"), ("gemma3", "F32")],
)
def test_float_and_dequantized_types_generate_transformers_greedy_tokens(gguf_files, arch, kind):
    """fp32: exactly transformers' greedy tokens on its own reading of the file, for the float
    types and for the 4/5/6-bit types (dequantized: the same values), on each architecture."""
    path = gguf_files[arch, kind]
    _, ours = _tokenmill_greedy(path, 8)
    reference = hf_model_from_gguf(path)
    assert ours == [_hf_greedy(reference, p, 8) for p in PROMPTS]


@pytest.mark.parametrize(("arch", "kind"), [("llama", "Q8_0"), ("qwen3", "Q8_0"), ("phi3", "Q8_0"), ("llama", "Q4_1")])
def test_kept_blocks_run_with_the_files_numbers(gguf_files, arch, kind):
    """Q8_0 layers (the lm_head too, from the tied embedding's blocks) are int8 weight-only layers and
    Q4_0 / Q4_1 layers 4-bit ones, holding the file's values and fp16 scales, nothing quantized again;
    greedy tokens equal transformers' on its dequantized reading of the file, and the fully
    dequantized copy (the agreement benchmark's reference) gives them too."""
    import gguf

    from tokenmill.models.layers.linear import Linear
    from tokenmill.models.layers.quantization.gguf import GGUFBlocks
    from tokenmill.models.layers.quantization.int4 import Int4LinearMethod
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

    path = gguf_files[arch, kind]
    llm, ours = _tokenmill_greedy(path, 8)
    assert llm.engine.model_name == f"{arch}.{kind}"  # (the file's name: what the API serves it as)
    methods = {name: m.quant_method for name, m in llm.engine.model.named_modules() if isinstance(m, Linear)}
    method_class = Int8LinearMethod if kind == "Q8_0" else Int4LinearMethod
    assert all(type(m) is method_class and isinstance(m.source, GGUFBlocks) for m in methods.values()), methods
    assert any(name.endswith("lm_head") for name in methods)
    down_name, down = next((n, m) for n, m in llm.engine.model.named_modules() if n.endswith("0.mlp.down_proj"))
    blocks = gguf_loader.gguf_blocks(
        next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    )
    if kind == "Q8_0":
        q, s = down.quant_method.quantized(down)
        assert torch.equal(q, torch.from_numpy(blocks["qweight"])) and s.dtype == torch.float16, down_name
        assert np.array_equal(s.numpy(), blocks["scales"])
    expected = torch.from_numpy(gguf_loader.blocks_dequantized(blocks))
    assert torch.equal(down.dequantized(torch.float32), expected)
    reference = hf_model_from_gguf(path)
    assert ours == [_hf_greedy(reference, p, 8) for p in PROMPTS]
    llm.engine.close()
    dequantized = dequantized_model_dir(gguf_model_dir(path))
    assert ConvertedGGUF.read(dequantized).kept == {}
    float_llm, float_tokens = _tokenmill_greedy(dequantized, 8)
    assert not any(
        isinstance(m.quant_method, (Int8LinearMethod, Int4LinearMethod))
        for m in float_llm.engine.model.modules()
        if isinstance(m, Linear)
    )
    assert float_tokens == ours


def _q8_0_layer(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, kernels: bool):
    from tokenmill.models.layers.linear import Linear
    from tokenmill.models.layers.quantization.gguf import GGUFBlocks
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

    layer = Linear(q.shape[1], q.shape[0], bias=True)
    layer.use_method(Int8LinearMethod(kernels, source=GGUFBlocks("Q8_0")))
    layer.qweight = torch.nn.Parameter(q, requires_grad=False)
    layer.scales = torch.nn.Parameter(scales, requires_grad=False)
    layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer.quant_method.process_weights_after_loading(layer, [])
    return layer


@pytest.mark.skipif(not build.load(), reason="tokenmill's CPU kernels are not built here")
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 70), (576, 200)])
def test_q8_0_layers_multiply_by_the_files_fp16_scales(rows, in_features, out_features):
    """Q8_0 values with fp16 scales (most of them no bf16 values) run on the int8 kernels as they
    are: the product is the exact dequantized weight's (int8 x fp16 is exact in fp32) times the
    int16-rounded activations, as for tokenmill's own bf16 scales; the fused decoder layers get the
    fp16 scales too; without the kernels the exact product."""
    from tests.kernels.test_cpu_kernels import _int8_reference

    gen = torch.Generator().manual_seed(rows + in_features)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out_features, in_features // 32, generator=gen) * 0.01 + 1e-3).half()
    assert not torch.equal(scales.bfloat16().half(), scales)
    bias = torch.randn(out_features, generator=gen)
    kernel, fallback = _q8_0_layer(q, scales, bias, True), _q8_0_layer(q, scales, bias, False)
    assert all(torch.equal(a, b) for a, b in zip(kernel.quant_method.quantized(kernel), (q, scales)))
    assert kernel.quant_method.fused_projection(kernel, torch.float32).scales.dtype == torch.float16
    weight = q.double() * scales.double().repeat_interleave(32, dim=1)
    assert torch.equal(kernel.dequantized(torch.float32).double(), weight)
    x = torch.randn(rows, in_features, generator=gen)
    fp32_rounding = 1e-6 * (x.double().abs() @ weight.abs().t()) + 1e-5
    reference = _int8_reference(x, q, scales.float(), 32) + bias.double()
    assert bool(((kernel(x).double() - reference).abs() <= fp32_rounding).all())
    assert bool(((kernel.logits(x).double() - reference).abs() <= fp32_rounding).all())
    exact = x.double() @ weight.t() + bias.double()
    assert bool(((fallback(x).double() - exact).abs() <= fp32_rounding).all())
    bf16 = kernel(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert bool(((bf16.double() - exact).abs() <= exact.abs() * 2.0**-7 + 0.05 * exact.abs().mean()).all())


def test_bf16_weights_keep_the_files_scales(gguf_files):
    """--dtype bfloat16 on a CPU without native bf16 rounds the float weights to bf16 values (fp32
    arithmetic); a kept layer's fp16 scales are the file's numbers and stay as they are."""
    from tokenmill.engine.setup import round_weights
    from tokenmill.models.model_loader.loader import load_model

    model, _ = load_model(gguf_model_dir(gguf_files["llama", "Q8_0"]), torch.float32, torch.device("cpu"), False)
    down = model.get_submodule("layers.0.mlp.down_proj")
    scales = down.scales.detach().clone()
    assert not torch.equal(scales.bfloat16().half(), scales)
    round_weights(model, torch.bfloat16)
    assert torch.equal(down.scales, scales)
    norm = model.get_submodule("layers.0.input_layernorm").weight
    assert torch.equal(norm, norm.bfloat16().float())  # (float weights: rounded)


def test_the_copy_is_made_once_per_file_version(gguf_files, monkeypatch):
    """A second start reuses the converted copy (nothing read from the file); a changed file (its
    modification time) gets a new copy and the old one is removed."""
    path = gguf_files["llama", "Q4_0"]
    first = gguf_model_dir(path)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    with monkeypatch.context() as patched:
        patched.setattr(gguf_loader, "_convert", no_conversion)
        assert gguf_model_dir(path) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = gguf_model_dir(path)
    assert second != first and second.exists() and not first.exists()


def test_unsupported_architectures_and_types_are_refused_by_name(tmp_path, gguf_files):
    import gguf

    falcon = gguf.GGUFWriter(tmp_path / "falcon.gguf", "falcon")
    falcon.add_block_count(1)
    falcon.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    falcon.write_header_to_file()
    falcon.write_kv_data_to_file()
    falcon.write_tensors_to_file()
    falcon.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'falcon' is not supported"):
        gguf_model_dir(tmp_path / "falcon.gguf")

    source = gguf.GGUFReader(gguf_files["llama", "F32"])
    mixed = gguf.GGUFWriter(tmp_path / "q3k.gguf", "llama")
    for tensor in source.tensors:
        data = np.array(tensor.data)
        if tensor.name == "blk.1.ffn_up.weight":
            blocks = random_k_blocks(data.shape, "Q3_K", np.random.default_rng(0))
            mixed.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q3_K)
        else:
            mixed.add_tensor(tensor.name, data)
    mixed.add_block_count(2)
    mixed.write_header_to_file()
    mixed.write_kv_data_to_file()
    mixed.write_tensors_to_file()
    mixed.close()
    with pytest.raises(ModelLoadError, match="tensor blk.1.ffn_up.weight is of GGUF type Q3_K"):
        gguf_model_dir(tmp_path / "q3k.gguf")

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        gguf_model_dir(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        gguf_model_dir(tmp_path / "missing.gguf")


def test_cli_refuses_an_unsupported_gguf_in_one_line(tmp_path):
    """`tokenmill generate --model file.gguf` with an unsupported architecture: exit 2, one line."""
    import subprocess
    import sys

    import gguf

    writer = gguf.GGUFWriter(tmp_path / "mamba.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    env = {**os.environ, "TOKENMILL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "generate", "--model", str(tmp_path / "mamba.gguf"), "--prompt", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "GGUF architecture 'mamba' is not supported" in done.stderr and "Traceback" not in done.stderr


def test_a_kept_layer_without_its_scales_fails_loudly(gguf_files, tmp_path):
    """A converted copy whose Q8_0 layer lost its scales is refused by name."""
    import shutil

    from safetensors.torch import save_file

    from tokenmill.models.model_loader.loader import load_model

    copy = Path(shutil.copytree(gguf_model_dir(gguf_files["llama", "Q8_0"]), tmp_path / "copy"))
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.scales"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="weights missing from the checkpoint: layers.0.mlp.gate_up_proj.scales"):
        load_model(copy, torch.float32, torch.device("cpu"), progress=False)


def test_the_default_model_is_the_bundled_gguf_dequantized(default_model_dir):
    """The bundled SmolLM2 goes through the same conversion, every tensor dequantized (its Q8_0
    embedding too) and its published dtype (bf16) recorded for --dtype auto."""
    summary = ConvertedGGUF.read(default_model_dir)
    assert summary is not None and not summary.keep_quantized and not summary.kept
    assert "Q8_0" in summary.dequantized and "Q4_1" in summary.dequantized
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
