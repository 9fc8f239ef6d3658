"""Load a local Hugging Face model directory into tokenmill's own model code."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from tokenmill.models.gpt2 import GPT2ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.parallel import NO_TP, TPInfo, check_shardable, local_spec, shard_state
from tokenmill.models.spec import ModelSpec, spec_from_hf_config

logger = logging.getLogger(__name__)

MODEL_CLASSES = {"llama": LlamaForCausalLM, "gpt2": GPT2ForCausalLM}


def load_spec(model_dir: Path) -> ModelSpec:
    from transformers import AutoConfig

    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}/config.json is missing")
    config = AutoConfig.from_pretrained(model_dir)
    eos: list[int] | None = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
        eos = value if isinstance(value, list) else ([value] if value is not None else None)
    return spec_from_hf_config(config, eos)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise FileNotFoundError(f"no weights in {model_dir}: expected model.safetensors or pytorch_model.bin")


def _iter_tensors(files: list[Path]):
    from safetensors import safe_open

    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
                yield name, tensor


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, progress: bool = True,
               tp: TPInfo = NO_TP) -> tuple[nn.Module, ModelSpec]:
    """The model (this rank's shard of it under tensor parallelism) and the spec of its shapes."""
    from tqdm.auto import tqdm

    full_spec = load_spec(model_dir)
    check_shardable(full_spec, tp.world_size)
    spec = local_spec(full_spec, tp)
    cls = MODEL_CLASSES[spec.family]
    with torch.device("meta"):
        model = cls(spec, tp) if tp.enabled else cls(spec)  # (only the Llama family takes tp)
    transposed = getattr(cls, "transposed_weights", ())
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor | None]] = {}
    fused_parts = {"qkv": 3, "gate_up": 2}
    files = _weight_files(model_dir)
    for hf_name, tensor in tqdm(_iter_tensors(files), desc=f"Loading {model_dir.name}", unit=" tensors", disable=not progress):
        name, part, group = cls.hf_to_local(hf_name)
        if name not in expected:
            continue  # e.g. attn.bias masks in old GPT-2 checkpoints, rotary inv_freq
        if name.endswith(transposed) and tensor.dim() == 2:
            tensor = tensor.t()
        tensor = tensor.to(dtype=dtype).contiguous()
        if group is None:
            state[name] = tensor
            continue
        slots = fused.setdefault(name, [None] * fused_parts[group])
        slots[part] = tensor
        if all(t is not None for t in slots):
            state[name] = torch.cat(slots, dim=0)
            del fused[name]
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise FileNotFoundError(f"weights missing from {model_dir}: {', '.join(missing[:8])}")
    state = shard_state(state, full_spec, tp)
    model.load_state_dict(state, strict=False, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight if spec.family == "llama" else model.wte.weight
    model.rebuild_buffers()
    model.to(device)
    model.eval()
    return model, spec
