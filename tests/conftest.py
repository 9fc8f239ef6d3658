"""Shared fixtures: small models built locally (nothing is downloaded) and HF references."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch


def pytest_addoption(parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="run the full-size stress tests in tests/stress (>10 minutes); default: short versions")


def _save_random_model(config, tokenizer_dir: Path, target: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tokenmill.models.hub import default_model_dir as resolve

    return resolve()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, request) -> Path:
    from tokenmill.models.hub import make_tiny_model

    # $TOKENMILL_TEST_TOKENIZER: a tokenizer directory, for machines without the bundled model
    # (bench/gpu_check.sh on a GPU machine); otherwise the default model's tokenizer.
    tokenizer = os.environ.get("TOKENMILL_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir=tokenizer)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, default_model_dir) -> Path:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=49152, n_positions=1024, n_embd=128, n_layer=3, n_head=4,
                        bos_token_id=1, eos_token_id=2)
    return _save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-gpt2"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, default_model_dir) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         rope_scaling={"rope_type": "linear", "factor": 2.0})
    return _save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-qwen2"), seed=2)


def mixed_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (ids from the common range of the SmolLM2 vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


_HF_CACHE: dict = {}


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers generate(do_sample=False), one prompt at a time, no padding."""
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), tuple(prompt_ids), max_new_tokens)
    if key not in _HF_CACHE:
        model = _HF_CACHE.get(str(model_dir))
        if model is None:
            model = _HF_CACHE[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        _HF_CACHE[key] = out[0, len(prompt_ids):].tolist()
    return _HF_CACHE[key]
