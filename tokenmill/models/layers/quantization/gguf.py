"""The quantized layers of a GGUF file, run with the file's own numbers.

model_loader/gguf.py converts a `.gguf` file into a directory whose config.json's quantization_config
(`quant_method` "tokenmill_gguf") names the linear layers it keeps in their GGUF type, and whose
checkpoint holds each such layer's blocks unpacked (every other tensor is float):
- Q8_0 (blocks of 32 int8 values with one fp16 scale): `qweight` int8 [out, in] and `scales` fp16
  [out, in / 32], run as weight-only int8 layers (int8.py), whose kernels take groups of 32 with
  fp16 scales as they are;
- Q4_0 (32 4-bit values with one fp16 scale d: w = d * (q - 8)) and Q4_1 (d and an fp16 minimum m:
  w = d * q + m): `qweight` uint8 [out, in] (0-15), `scales` fp16 [out, in / 32] and, for Q4_1,
  `offsets` fp16, run as 4-bit layers (int4.py: zero point 8, or offsets).
Nothing is quantized again: the layers multiply by exactly the weights llama.cpp's dequantization
gives.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.models.layers.linear import Linear, LinearBackend, LinearMethod, linear_parameter
from tokenmill.models.layers.quantization import QuantizationConfig
from tokenmill.models.layers.quantization.int4 import Int4LinearMethod, Int4Weight
from tokenmill.models.layers.quantization.int8 import Int8LinearMethod, Int8Weight

QUANT_METHOD = "tokenmill_gguf"
BLOCK = 32  # weights per block (and per scale) of the GGUF types kept
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def _loaded(layer: Linear, name: str) -> torch.Tensor:
    tensor: torch.Tensor = getattr(layer, name).data
    return tensor


def _check_finite(layer: Linear, name: str) -> torch.Tensor:
    tensor = _loaded(layer, name)
    if not bool(tensor.isfinite().all()):
        raise ModelLoadError(f"tensor {getattr(layer, 'name', '?')}.{name}: not finite")
    return tensor


class GGUFBlocks(LinearMethod):
    """The tensors of a layer kept in its GGUF type (`kind`), as the int8 or 4-bit method's source."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.name = f"GGUF {kind}"
        self.tensor_names = ("qweight", "scales", "offsets") if kind == "Q4_1" else ("qweight", "scales")

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.out_features, layer.in_features
        linear_parameter(layer, "qweight", (n, k), torch.int8 if self.kind == "Q8_0" else torch.uint8, output_dim=0)
        for name in self.tensor_names[1:]:
            linear_parameter(layer, name, (n, k // BLOCK), torch.float16, output_dim=0)

    def decode_int8(self, layer: Linear) -> Int8Weight:
        return Int8Weight(_loaded(layer, "qweight"), _check_finite(layer, "scales"))

    def decode_int4(self, layer: Linear) -> Int4Weight:
        values = _loaded(layer, "qweight")
        if bool((values > 15).any()):
            raise ModelLoadError(f"tensor {getattr(layer, 'name', '?')}.qweight: 4-bit values above 15")
        scales = _check_finite(layer, "scales")
        if self.kind == "Q4_0":
            return Int4Weight(values, scales, None, 8, None, None)
        return Int4Weight(values, scales, None, 0, _check_finite(layer, "offsets"), None)


class GGUFConfig(QuantizationConfig):
    """A converted GGUF file's kept layers (config.json: `layers`, {checkpoint module: GGUF type})."""

    name = "gguf"

    def __init__(self, declared: dict[str, Any], where: str) -> None:
        layers = declared.get("layers")
        if not isinstance(layers, dict) or any(kind not in KEPT_TYPES for kind in layers.values()):
            raise ModelLoadError(f"{where}: {QUANT_METHOD} without a layers map of {', '.join(KEPT_TYPES)} types")
        self.layers: dict[str, str] = layers

    def linear_method(
        self, name: str, parts: tuple[str, ...], layer: Linear, backend: LinearBackend
    ) -> LinearMethod | None:
        kinds = {self.layers.get(part) for part in parts}
        if len(kinds) > 1:
            types = ", ".join(f"{part} {self.layers.get(part) or 'float'}" for part in parts)
            raise ModelLoadError(f"layer {name}: its parts are of different GGUF types ({types}); one layer has one")
        kind = kinds.pop()
        if kind is None:
            return None
        if layer.in_features % BLOCK:
            raise ModelLoadError(f"layer {name}: {layer.in_features} inputs are not whole {kind} blocks of {BLOCK}")
        if kind == "Q8_0":
            return Int8LinearMethod(backend.kernels, source=GGUFBlocks(kind))
        return Int4LinearMethod(backend.kernels, source=GGUFBlocks(kind))
