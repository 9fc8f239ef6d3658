"""Engine setup: device and dtype, the model (loaded and prepared alike on every tensor-parallel
rank), the tokenizer, and how many KV cache blocks the memory budget holds."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import AutoTokenizer

from tokenmill.engine.config import EngineConfig, parse_memory
from tokenmill.engine.precision import Precision
from tokenmill.engine.worker.kv_cache import bytes_per_block
from tokenmill.models.layers.fused_layer import fuse_decoder_layers
from tokenmill.models.layers.parallel import TPInfo, check_shardable
from tokenmill.models.model_loader.linear_setup import process_weights_after_loading
from tokenmill.models.model_loader.loader import load_model, load_spec, resolve_architecture
from tokenmill.models.model_loader.registry import NATIVE
from tokenmill.models.spec import ModelSpec

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_CAP = 4 << 30  # like vLLM's CPU default KV space: plenty for a CPU's batch sizes


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def check_tensor_parallel(config: EngineConfig, model_dir: Path, device: torch.device) -> None:
    """Refuse a tensor-parallel setup that cannot work, before any worker process starts."""
    world = config.tensor_parallel_size
    if world < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world}")
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {world} needs as many GPUs; {torch.cuda.device_count()} visible")
    if world == 1:
        return
    if resolve_architecture(model_dir, config.model_impl)[0].path != NATIVE:
        raise ValueError(
            "--tensor-parallel-size > 1 needs the native path (`tokenmill models`), not the generic transformers path"
        )
    check_shardable(load_spec(model_dir), world)


def load_prepared_model(
    config: EngineConfig,
    model_dir: Path,
    precision: Precision,
    device: torch.device,
    rank: int = 0,
    progress: bool = False,
) -> tuple[torch.nn.Module, ModelSpec]:
    """This rank's share of the model in `precision`, quantized, packed or compiled as the config asks."""
    model, spec = load_model(
        model_dir,
        precision.compute,
        device,
        progress=progress,
        tp=TPInfo(rank, config.tensor_parallel_size),
        max_model_len=config.max_model_len,
        model_impl=config.model_impl,
        packed_linear=packs_linear_weights(config, device),
        quantization=config.quantization,
    )
    if precision.weights != precision.compute:
        round_weights(model, precision.weights)
    prepare_model(model, config, device)
    return model, spec


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter rounded to `dtype`'s values. In place (the storage keeps the
    compute dtype: packing then holds the linear weights in `dtype`, see packed_linear.panel_dtype),
    except in modules that compute in their weights' dtype (MoE expert stacks): held in `dtype`."""
    for module in model.modules():
        narrow = getattr(module, "computes_in_weight_dtype", False)
        for parameter in module.parameters(recurse=False):
            if not parameter.is_floating_point():
                continue
            if narrow:
                parameter.data = parameter.data.to(dtype)
            else:
                parameter.copy_(parameter.to(dtype))


def packs_linear_weights(config: EngineConfig, device: torch.device) -> bool:
    """Whether float linear layers are packed for tokenmill's CPU kernels or oneDNN (not under
    --compile: inductor cannot lower ops on weights it did not pack itself)."""
    return config.packed_linear and device.type == "cpu" and not config.compile


def prepare_model(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
    """The loaded weights in their linear methods' layouts, decoder layers fused, the step
    compiled, as the config asks (every TP rank alike)."""
    process_weights_after_loading(model)
    if config.fused_layers and packs_linear_weights(config, device):
        fuse_decoder_layers(model)  # (where every projection's method takes the fused layer)
    if config.compile:
        # The dense parts of the step (attention stays eager); the token count is dynamic.
        logger.info("compiling the model step with torch.compile (first steps are slow)")
        model.forward = torch.compile(model.forward, dynamic=True)


def load_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer, or None (then only token-id prompts work)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no usable tokenizer in %s (%s): only token-id prompts will work", model_dir, exc)
        return None
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # incremental detokenization needs `tokenizers`
        raise ValueError(
            f"the tokenizer in {model_dir} ({type(tokenizer).__name__}) has no fast (tokenizers) "
            "backend; tokenmill needs one (a tokenizer.json)"
        )
    return tokenizer


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory:
        return parse_memory(config.kv_cache_memory)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.kv_cache_memory_fraction)
    return min(int(psutil.virtual_memory().available * config.kv_cache_memory_fraction), _CPU_DEFAULT_KV_CAP)


def num_kv_blocks(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    extra_bytes_per_block: int = 0,
) -> tuple[int, int]:
    """(blocks the budget holds, bytes per block); never more blocks than every sequence slot at full
    length could use (x2 for the prefix cache). `extra_bytes_per_block`: another cache indexed by
    the same blocks (a draft model's)."""
    bs = config.block_size
    per_block = bytes_per_block(bs, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype) + extra_bytes_per_block
    num_blocks = min(
        kv_budget_bytes(config, device) // per_block, 2 * config.max_num_seqs * -(-max_model_len // bs) + 1
    )
    if num_blocks < 2:
        raise ValueError(f"--kv-cache-memory is too small for a single {bs}-token block ({per_block} bytes)")
    return num_blocks, per_block
