"""Random LoRA adapters for benchmarks: PEFT directories (adapter_config.json + safetensors) of a
Llama-family model's q/k/v/o and gate/up/down projections, written without `peft` (a test-only
dependency). Their outputs are meaningless; their shapes, ranks and cost are those of real ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: the CLI registers this module's flags without loading torch)
    pass


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted projection of a Llama-family model, from its config."""
    from tokenmill.models.model_loader.loader import load_spec

    spec = load_spec(model_dir)
    q, kv, hidden, inter = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.hidden_size,
        spec.intermediate_size,
    )
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_random_adapter(model_dir: Path, target: Path, rank: int, seed: int) -> Path:
    """A rank-`rank` adapter of every projection of every layer (alpha = 2 * rank, PEFT's layout)."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.models.model_loader.loader import load_spec

    shapes = projection_shapes(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(load_spec(model_dir).num_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return target
