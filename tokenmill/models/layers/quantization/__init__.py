"""Quantized linear layers: which method each layer gets (see linear.py), from the checkpoint's own
`quantization_config` in config.json (no flag needed) or, for a float checkpoint, `--quantization`.

A checkpoint quantized by a method tokenmill does not run (bitsandbytes, EXL2, HQQ, ...) is refused
at startup naming the method: its packed tensors would otherwise be read as weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.errors import ModelLoadError

if TYPE_CHECKING:
    from tokenmill.models.layers.linear import Linear, LinearBackend, LinearMethod

# --quantization choices: a float checkpoint quantized at load
ONLINE_METHODS = ("int8", "int4")


class QuantizationConfig:
    """A checkpoint's (or --quantization's) quantization: the method of each linear layer."""

    name = ""

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        """The method of layer `name` (its checkpoint modules: `parts`), or None: the layer is float
        (the backend's float method; a quantized one computes on it too)."""
        raise NotImplementedError

    def ignored_tensors(self) -> tuple[str, ...]:
        """Suffixes of checkpoint tensors the format writes and the layers do not read."""
        return ()

    def expert_method(self) -> LinearMethod | None:
        """The method of each expert's linear layers in a mixture of experts, or None (stacked float)."""
        return None

    @property
    def prequantized(self) -> bool:
        """Whether the checkpoint holds the quantized tensors (else float weights quantized at load)."""
        return True


class OnlineQuantization(QuantizationConfig):
    """`--quantization int8` / `int4`: every linear layer of a float checkpoint quantized at load
    (int4: the lm_head in int8, the largest and most sensitive matrix, as llama.cpp's Q4 files keep
    their output matrix wider). Without tokenmill's CPU kernels the lm_head stays float (widening a
    quantized head on every call would cost a vocabulary-sized matrix per step)."""

    def __init__(self, name: str, kernels: bool) -> None:
        from tokenmill.models.layers.quantization.int4 import Int4LinearMethod
        from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

        self.name = name
        self.kernels = kernels
        self.head: LinearMethod = Int8LinearMethod(kernels)
        self.method: LinearMethod = Int4LinearMethod(kernels) if name == "int4" else self.head

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        if name.rpartition(".")[2] == "lm_head":
            return self.head if self.kernels else None
        return self.method

    def expert_method(self) -> LinearMethod | None:
        return self.method

    @property
    def prequantized(self) -> bool:
        return False


def quantization_config(
    raw_config: dict[str, Any], flag: str | None, kernels: bool, where: str
) -> QuantizationConfig | None:
    """The quantization of a checkpoint whose config.json is `raw_config` (`where`: its path, for
    errors), run with `--quantization flag`; None for a float model."""
    declared = raw_config.get("quantization_config")
    if declared is None:
        if flag is None:
            return None
        if flag not in ONLINE_METHODS:
            raise ModelLoadError(f"--quantization {flag}: not one of {', '.join(ONLINE_METHODS)}")
        return OnlineQuantization(flag, kernels)
    if not isinstance(declared, dict):
        raise ModelLoadError(f"{where}: quantization_config is not an object")
    method = str(declared.get("quant_method", "")).lower()
    if flag is not None:
        raise ModelLoadError(
            f"{where}: --quantization {flag} asks to quantize a checkpoint that is already quantized ({method}); "
            "leave the flag out"
        )
    from tokenmill.models.layers.quantization.formats import FORMATS

    if method not in FORMATS:
        raise ModelLoadError(
            f"{where}: quantization method {method!r} is not supported (supported: {', '.join(FORMATS)}; "
            f"float checkpoints also with --quantization {' or '.join(ONLINE_METHODS)})"
        )
    return FORMATS[method](declared, where)
