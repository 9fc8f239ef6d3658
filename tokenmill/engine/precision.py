"""`--dtype`: what it means for a model on a device (`Precision`), and what `auto` picks, and why.

`--dtype auto` on CPU picks bf16 only where the CPU computes bf16 natively (AMX or AVX512-BF16) and
the model was published in bf16/fp16; elsewhere fp32. A model trained and shipped in fp32 stays
fp32: bf16 would change its outputs for no reason it asked for. A model published in bf16 loses
nothing in fp32 on an AVX2 CPU: its weights are bf16 values, held in bf16 panels all the same
(packed_linear.panel_dtype), so fp32 runs it exactly at bf16's weight bytes.

`--dtype bfloat16` on a CPU without native bf16 means bf16 weights and KV cache with fp32 arithmetic
(see resolve_precision): such a CPU widens bf16 to fp32 to compute anyway.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.kernels.cpu_caps import CpuCaps, detect

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's other names for them
_HALF_PRECISION = {"float16", "bfloat16"}


def model_source_dtype(model_dir: Path | None) -> str | None:
    """The dtype a model was published in: its config's `dtype` (`torch_dtype` before transformers 5)."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("dtype") or section.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def choose_cpu_dtype(caps: CpuCaps, source_dtype: str | None) -> tuple[torch.dtype, str]:
    """(dtype, reason) for `--dtype auto` on CPU."""
    if not caps.native_bf16:
        return torch.float32, f"this CPU has no native bf16 (AMX or AVX512-BF16; it has {caps.describe()})"
    if source_dtype not in _HALF_PRECISION:
        return torch.float32, f"the model was published in {source_dtype or 'an unknown dtype'}, not bf16/fp16"
    units = " and ".join(name for name, has in (("AMX", caps.amx_bf16), ("AVX512-BF16", caps.avx512_bf16)) if has)
    return torch.bfloat16, f"this CPU computes bf16 natively ({units}) and the model was published in {source_dtype}"


def resolve_dtype(name: str, device: torch.device, model_dir: Path | None = None) -> torch.dtype:
    """The dtype `--dtype NAME` means on `device` for the model in `model_dir`; auto is logged with its reason."""
    if name != "auto":
        return DTYPES[DTYPE_ALIASES.get(name, name)]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtype, reason = choose_cpu_dtype(detect(), model_source_dtype(model_dir))
    logger.info("--dtype auto: %s on CPU, because %s", str(dtype).removeprefix("torch."), reason)
    return dtype


@dataclass(frozen=True)
class Precision:
    """What `--dtype` means for the engine: the dtype the model computes in (its activations and the
    model it is loaded as), and the one its weights are held in (and its KV cache by default)."""

    compute: torch.dtype
    weights: torch.dtype

    def describe(self) -> str:
        weights, compute = (str(d).removeprefix("torch.") for d in (self.weights, self.compute))
        return weights if weights == compute else f"{weights} weights, {compute} arithmetic"


def resolve_precision(name: str, device: torch.device, model_dir: Path | None = None) -> Precision:
    """`--dtype NAME` on `device`. bf16 on a CPU without native bf16 keeps bf16 weights (rounded to
    bf16, held in half the bytes on the panel GEMM) and KV cache, but computes in fp32: that CPU
    computes bf16 by widening to fp32 anyway, so rounding every activation back to bf16 between ops
    would only lose accuracy and time (`tokenmill bench offline --dtype bfloat16` and `tokenmill bench
    agreement --dtype bfloat16` measure both; OpenVINO does the same: fp32 inference precision on such
    CPUs)."""
    dtype = resolve_dtype(name, device, model_dir)
    if device.type == "cpu" and dtype == torch.bfloat16 and not detect().native_bf16:
        logger.info(
            "--dtype bfloat16: weights and KV cache in bf16, arithmetic in fp32, because this CPU has "
            "no native bf16 (%s)",
            detect().describe(),
        )
        return Precision(torch.float32, torch.bfloat16)
    return Precision(dtype, dtype)


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: the model's dtype for auto; int8 for int8 rows with a scale each
    (tokenmill.models.layers.kv_quant); a cache wider than the model is refused (it would only cost memory)."""
    if choice == "auto":
        return model_dtype
    if choice == "int8":
        return torch.int8
    dtype = DTYPES[choice]
    if dtype.itemsize > model_dtype.itemsize:
        raise ValueError(
            f"--kv-cache-dtype {choice} is wider than the model's {str(model_dtype).removeprefix('torch.')}"
        )
    return dtype
