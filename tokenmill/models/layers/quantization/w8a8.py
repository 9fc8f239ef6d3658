"""W8A8 linear layers: a checkpoint's int8 weights (one scale per output channel) times activations
rounded to int8 per token (compressed-tensors `int-quantized` with dynamic per-token activation
scales, as llm-compressor's W8A8 exports and vLLM compute them).

Each row of x is rounded by its own scale, s_x = max|x| / 127; the products with the int8 weights are
summed exactly in int32 over all of K, and scaled once: y = sum * s_x * s_w[column] (+ bias). A
token's result does not depend on the other tokens of its step. On CPU the product runs on
kernels/csrc/cpu/w8a8_linear.cpp, picked at run time by what the CPU has: AMX-int8 tiles (steps of 16
rows and more), AVX512-VNNI or AVX-VNNI dot products, else the same int32 sums from pmaddwd (every
path gives the same bits). Weights stream at one byte each, as int8 layers'; the activations are
int8 too, so a prefill's products are int8 dot products (4 per 32-bit lane and instruction) rather
than int16 pairs. Without tokenmill's kernels (a GPU) formats.py's method widens the weights instead.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import ops
from tokenmill.models.layers.linear import FusedProjection, Linear, LinearMethod, stored
from tokenmill.models.layers.quantization.int8 import Int8Source

# The kernel pads K with zero weights to a multiple of this (one AMX tile row of inputs).
QUAD_DEPTH = 64


def padded_inputs(in_features: int) -> int:
    return -(-in_features // QUAD_DEPTH) * QUAD_DEPTH


def pack_w8a8(
    values: torch.Tensor, scales: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, offsets, scales) of int8 values [N, K] and per-channel scales [N] (or [N, 1]) as the
    kernel reads them: panels of `width` output columns by quads of inputs, packed[p, j, 4c + t] =
    W[p * width + c, 4j + t] (K padded to QUAD_DEPTH, N to whole panels, with zeros); each column's
    128 * (sum of its weights) as int32 (x enters the dot products as unsigned bytes x + 128); its
    fp32 scale."""
    n, k = values.shape
    count, kp = -(-n // width), padded_inputs(k)
    padded = values.new_zeros(count * width, kp)
    padded[:n, :k] = values
    packed = padded.view(count, width, kp // 4, 4).transpose(1, 2).reshape(count, kp // 4, 4 * width)
    offsets = torch.zeros(count * width, dtype=torch.int32)
    offsets[:n] = 128 * values.sum(dim=1, dtype=torch.int32)
    column_scales = torch.zeros(count * width, dtype=torch.float32)
    column_scales[:n] = scales.reshape(n).float()
    return packed.contiguous(), offsets, column_scales


class W8A8LinearMethod(LinearMethod):
    """int8 x int8 layers on tokenmill's CPU kernels, from a format's method (`source`, formats.py)
    that reads the checkpoint's tensors and decodes them into int8 values and per-channel scales."""

    name = "w8a8"

    def __init__(self, source: Int8Source) -> None:
        self.source = source
        self.tensor_names = source.tensor_names

    def create_weights(self, layer: Linear) -> None:
        self.source.create_weights(layer)

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        width = ops.linear_panel_width()
        columns = -(-layer.out_features // width) * width
        return [
            (columns * padded_inputs(layer.in_features), torch.int8),
            (columns, torch.int32),
            (columns, torch.float32),
        ]

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = self.source.decode_int8(layer)
        for name in self.tensor_names:
            delattr(layer, name)
        packed, offsets, scales = pack_w8a8(weight.values, weight.scales, ops.linear_panel_width())
        layer.qweight = stored(storage, 0, packed)
        layer.column_offsets = stored(storage, 1, offsets)
        layer.scales = stored(storage, 2, scales)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.w8a8_linear(x, layer.qweight, layer.column_offsets, layer.scales, layer.bias, layer.out_features)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.w8a8_linear(
            x.float(), layer.qweight, layer.column_offsets, layer.scales, layer.bias, layer.out_features
        )

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        if activations in (torch.float32, torch.bfloat16):
            return FusedProjection(layer.qweight, layer.scales, layer.bias, offsets=layer.column_offsets)
        return None

    def quantized(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [N, K], fp32 scales [N]), unpacked from the panels."""
        n, k = layer.out_features, layer.in_features
        count, quads, row = layer.qweight.shape
        values = layer.qweight.view(count, quads, row // 4, 4).transpose(1, 2).reshape(-1, 4 * quads)
        return values[:n, :k], layer.scales[:n]

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        values, scales = self.quantized(layer)
        return (values.float() * scales[:, None]).to(dtype)

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.qweight, layer.column_offsets, layer.scales]
