"""GGUF files as models (tokenmill/models/model_loader/gguf.py): every supported tensor type read as
transformers reads it, Q8_0 on the int8 kernels with the file's own values and scales, the cached
copy keyed by the file, and refusals by name.

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
from tokenmill.models.model_loader import gguf as gguf_loader
from tokenmill.models.model_loader.gguf import ConvertedGGUF, gguf_model_dir

ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


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
    """A converted copy's tensors as values (int8 weights times their scales)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(gguf_loader.SCALE_SUFFIX):
            continue
        if tensor.dtype == torch.int8:
            scales = tensors[name + gguf_loader.SCALE_SUFFIX]
            tensor = tensor.float() * scales.float().repeat_interleave(gguf_loader.Q8_0_BLOCK, dim=1)
        out[name] = tensor
    return out


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_every_type_converts_to_transformers_values(gguf_files, kind):
    """Each type's tensors come out as transformers dequantizes the file: float types in their own
    dtype, Q8_0 as its int8 values with their fp16 scales (exactly the blocks' numbers), the 4/5/6-bit
    types dequantized to fp32; with transformers' config and the tokenizer and chat template of the
    file's metadata."""
    from transformers import AutoTokenizer

    path = gguf_files["llama", kind]
    converted = gguf_model_dir(path)
    tensors = {}
    for shard in converted.glob("*.safetensors"):
        tensors.update(load_file(shard))
    reference = hf_model_from_gguf(path).state_dict()
    ours = _dequantized(tensors)
    assert set(ours) == set(reference) - {"lm_head.weight"}  # (tied to the embedding)
    for name, values in ours.items():
        assert torch.equal(values.float(), reference[name].float()), name
    matrices = {t.dtype for name, t in tensors.items() if t.dim() == 2 and not name.endswith("_scale")}
    expected = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "Q8_0": torch.int8}
    assert matrices == {expected.get(kind, torch.float32)}
    if kind == "Q8_0":
        scales = {t.dtype for name, t in tensors.items() if name.endswith("_scale")}
        assert scales == {torch.float16}
    summary = ConvertedGGUF.read(converted)
    dequantized = [kind] if kind in gguf_loader.DEQUANTIZED_TYPES else []
    assert summary.tensor_types[kind] > 0 and summary.dequantized_types == dequantized
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
    + [("gemma2", "F32")],
)
def test_float_and_dequantized_types_generate_transformers_greedy_tokens(gguf_files, arch, kind):
    """fp32: exactly transformers' greedy tokens on its own reading of the file, for the float
    types and for the 4/5/6-bit types (dequantized: the same values), on each architecture."""
    path = gguf_files[arch, kind]
    _, ours = _tokenmill_greedy(path, 8)
    reference = hf_model_from_gguf(path)
    assert ours == [_hf_greedy(reference, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_q8_0_runs_on_int8_kernels_with_the_files_scales(gguf_files, arch):
    """Q8_0: every linear layer (the tied lm_head too) is an int8 weight-only layer holding the file's
    int8 values and fp16 scales, nothing quantized again; greedy tokens equal transformers' on its
    dequantized reading of the file; --quantization none runs the same weights dequantized."""
    from tokenmill.kernels.ops import cpu_kernels_available
    from tokenmill.models.layers.quant import WeightOnlyInt8Linear

    path = gguf_files[arch, "Q8_0"]
    llm, ours = _tokenmill_greedy(path, 8)
    assert llm.engine.model_name == f"{arch}.Q8_0"  # (the file's name: what the API serves it as)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, WeightOnlyInt8Linear)]
    linears = [m for m in llm.engine.model.modules() if isinstance(m, torch.nn.Linear)]
    kept = [m for m in linears if m.out_features == TINY_VOCAB_SIZE]  # a head kept in float without kernels
    assert layers and all(layer.from_checkpoint for layer in layers) and len(linears) == len(kept)
    assert not cpu_kernels_available(torch.device("cpu")) or not kept
    import gguf

    reader = gguf.GGUFReader(path)
    q8 = {t.name: t for t in reader.tensors if t.tensor_type.name == "Q8_0"}
    values, scales = gguf_loader.q8_0_values(q8["blk.0.ffn_down.weight"])
    down = next(m for name, m in llm.engine.model.named_modules() if name.endswith("0.mlp.down_proj"))
    q, s = down.quantized()
    assert torch.equal(q, torch.from_numpy(values)) and s.dtype == torch.float16
    assert np.array_equal(s.numpy(), scales)
    reference = hf_model_from_gguf(path)
    assert ours == [_hf_greedy(reference, p, 8) for p in PROMPTS]
    llm.engine.close()
    float_llm, float_tokens = _tokenmill_greedy(path, 8, quantization="none")
    assert not any(isinstance(m, WeightOnlyInt8Linear) for m in float_llm.engine.model.modules())
    assert float_tokens == ours


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


def test_an_int8_weight_without_its_scales_fails_loudly(gguf_files, tmp_path):
    """A converted copy whose int8 weight lost its scales (or the reverse) is refused by name."""
    import shutil

    from safetensors.torch import save_file

    from tokenmill.models.model_loader.loader import load_model

    copy = Path(shutil.copytree(gguf_model_dir(gguf_files["llama", "Q8_0"]), tmp_path / "copy"))
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="without their pair: model.layers.0.mlp.up_proj.weight$"):
        load_model(copy, torch.float32, torch.device("cpu"), progress=False)


def test_the_default_model_is_the_bundled_gguf_dequantized(default_model_dir):
    """The bundled SmolLM2 goes through the same conversion, every tensor dequantized (its Q8_0
    embedding too) and its published dtype (bf16) recorded for --dtype auto."""
    summary = ConvertedGGUF.read(default_model_dir)
    assert summary is not None and not summary.q8_0_as_int8 and "Q8_0" in summary.dequantized_types
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
