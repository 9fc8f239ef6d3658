"""`--dtype auto`: the compute dtype for a model on a device, and why.

On CPU, bf16 is only faster than fp32 when the CPU computes in bf16 natively (AMX or AVX512-BF16);
elsewhere (AVX2-only CPUs) bf16 weights are widened to fp32 as they stream (half the bytes), but the
elementwise ops and the Python between layers run in bf16 and the one-call fp32 decoder layer does
not apply: SmolLM2 batch-1 21.0 vs 19.8 ms/step, 221 vs ~230 offline tok/s on an AMD Zen3. And a
model trained and shipped in fp32 stays fp32: bf16 would change its outputs for no reason it asked for.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tokenmill.kernels.cpu_caps import CpuCaps, detect

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HALF_PRECISION = {"float16", "bfloat16"}


def model_source_dtype(model_dir: Path | None) -> str | None:
    """The dtype a model was published in: its config's `dtype` (`torch_dtype` before transformers 5)."""
    from tokenmill.models.hub import DEFAULT_MODEL_SOURCE_DTYPE, is_default_model

    if model_dir is None:
        return None
    if is_default_model(model_dir):
        return DEFAULT_MODEL_SOURCE_DTYPE
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
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtype, reason = choose_cpu_dtype(detect(), model_source_dtype(model_dir))
    logger.info("--dtype auto: %s on CPU, because %s", str(dtype).removeprefix("torch."), reason)
    return dtype


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: the model's dtype for auto; int8 for int8 rows with a scale each
    (tokenmill.models.kv_quant); a cache wider than the model is refused (it would only cost memory)."""
    if choice == "auto":
        return model_dtype
    if choice == "int8":
        return torch.int8
    dtype = DTYPES[choice]
    if dtype.itemsize > model_dtype.itemsize:
        raise ValueError(f"--kv-cache-dtype {choice} is wider than the model's {str(model_dtype).removeprefix('torch.')}")
    return dtype
