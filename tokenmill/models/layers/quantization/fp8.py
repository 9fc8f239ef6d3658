"""FP8 (e4m3) linear layers held in 8 bits: compressed-tensors `float-quantized` (per-channel or 128 x 128
block scales) and transformers' `fp8` checkpoints (DeepSeek-V3, Qwen3-FP8) on tokenmill's CPU kernels.

The checkpoint's e4m3 bytes are kept as they are, in the panels of the panel GEMM (one byte per
weight), with its scales per column and group of inputs (a per-channel scale: one group; a block
scale: groups of the block's width, each column with its block row's scale). The kernel
(kernels/csrc/cpu/fp8_linear.cpp) widens each weight to fp32 as it streams and multiplies it by its
scale, w = fp8 * scale rounded once to fp32: exactly the weight of a float model carrying the
dequantized checkpoint, so only the order of the fp32 sums differs from it. Activations stay in the
model's dtype (the FP8 activation scales these checkpoints declare serve FP8 GEMMs, which CPUs lack).

Not converted to int8: an e4m3 value has 3 mantissa bits at any of 16 exponents, and int8 with one
scale per channel (or group) holds a channel's values exactly only where they span at most ~3
binades; the smaller weights of a real channel would be rounded, which the widened bytes never are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.kernels import ops
from tokenmill.models.layers.linear import CheckpointTensors, FusedProjection, Linear, LinearMethod, stored
from tokenmill.models.layers.quantization.int8 import panels

# The kernel widens e4m3 bytes to their values times 2^-8 (fp16 bits, see fp8_linear.cpp): the scales
# it takes carry the 2^8 (a power of two, so the products are unchanged).
_E4M3_AS_FP16 = 256.0


def pack_fp8(values: torch.Tensor, scales: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) as the kernel reads them: e4m3 bytes [N, K] in panels [panels, K, width], fp32
    scales [N, groups] in panels [panels, groups, width] times 2^8 (columns past N zero)."""
    return panels(values, width), panels(scales.float() * _E4M3_AS_FP16, width)


@dataclass
class FP8Weight:
    """A layer's FP8 weight: e4m3 bytes [out, in] (uint8), fp32 scales [out, groups], one per column
    and group of `group_size` consecutive inputs (the last group shorter where it does not divide in)."""

    values: torch.Tensor
    scales: torch.Tensor
    group_size: int


class FP8Source(CheckpointTensors, Protocol):
    """A format's method (formats.py): declares a layer's checkpoint tensors, decodes them into an
    FP8Weight and knows its scale groups."""

    def scale_groups(self, layer: Linear) -> int: ...

    def decode_fp8(self, layer: Linear) -> FP8Weight: ...


class FP8LinearKernelMethod(LinearMethod):
    """FP8 layers on tokenmill's CPU kernels, from a format's method (`source`, formats.py) that reads
    the checkpoint's tensors (`decode_fp8`: an FP8Weight) and knows its scale groups (`scale_groups`)."""

    name = "fp8"

    def __init__(self, source: FP8Source) -> None:
        self.source = source
        self.tensor_names = source.tensor_names

    def create_weights(self, layer: Linear) -> None:
        self.source.create_weights(layer)

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        columns = -(-layer.out_features // ops.linear_panel_width()) * ops.linear_panel_width()
        groups = self.source.scale_groups(layer)
        return [(columns * layer.in_features, torch.uint8), (columns * groups, torch.float32)]

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = self.source.decode_fp8(layer)
        for name in self.tensor_names:
            delattr(layer, name)
        packed, scales = pack_fp8(weight.values, weight.scales, ops.linear_panel_width())
        layer.qweight = stored(storage, 0, packed)
        layer.scales = stored(storage, 1, scales)
        layer.group_size = weight.group_size

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, layer.qweight, layer.scales, layer.group_size, layer.bias, layer.out_features)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.apply(layer, x.float())

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        if activations in (torch.float32, torch.bfloat16):
            return FusedProjection(layer.qweight, layer.scales, layer.bias, group_size=layer.group_size)
        return None

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """fp8 * scale per weight, as the kernel computes it (exact in fp32)."""
        n, k = layer.out_features, layer.in_features
        values = layer.qweight.transpose(1, 2).reshape(-1, k)[:n].view(torch.float8_e4m3fn).float()
        scales = layer.scales.transpose(1, 2).reshape(-1, layer.scales.shape[1])[:n] / _E4M3_AS_FP16
        return (values * scales.repeat_interleave(layer.group_size, dim=1)[:, :k]).to(dtype)

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.qweight, layer.scales]
