"""LoRA adapters for tests, made with `peft` itself on the tiny models, and HF + peft references.

peft initialises B to zero (an adapter that changes nothing, so a test of it could not fail): both
matrices are overwritten with random values, scaled so that each adapted layer's delta is about a
third of the layer's output (the sharpened base weights give outputs of std ~2), enough to change
greedy tokens without washing out the base model's sharp attention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DELTA_STD = 0.7  # std of an adapted layer's LoRA delta for unit-variance inputs

_REFERENCE_CACHE: dict[Any, list[int]] = {}


def make_peft_adapter(
    model_dir: Path, target: Path, *, seed: int, r: int, lora_alpha: float, target_modules: list[str], **config: Any
) -> Path:
    """`get_peft_model` on the model, random non-zero A and B, `save_pretrained` into `target`."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=0.0, **config)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            rank, scale = a.shape[0], module.scaling["default"]
            a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=generator) * DELTA_STD / (rank**0.5 * scale))
    peft_model.save_pretrained(target)
    return target


def _reference_model(model_dir: Path, adapter_dir: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), str(adapter_dir))
    if key not in _REFERENCE_CACHE:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        _REFERENCE_CACHE[key] = model.eval()
    return _REFERENCE_CACHE[key]


def peft_last_hidden(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int]) -> torch.Tensor:
    """Reference: the final norm's output at the last prompt position, peft applying the adapter."""
    with torch.inference_mode():
        out = _reference_model(model_dir, adapter_dir)(torch.tensor([prompt_ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1]


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: HF generate (fp32, greedy, one prompt, no padding) with peft applying the adapter
    (None: the base model)."""
    key = (str(model_dir), str(adapter_dir), tuple(prompt_ids), max_new_tokens)
    if key not in _REFERENCE_CACHE:
        model = _reference_model(model_dir, adapter_dir)
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        _REFERENCE_CACHE[key] = out[0, len(prompt_ids) :].tolist()
    return _REFERENCE_CACHE[key]
