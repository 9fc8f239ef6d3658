"""4-bit weight-only linear layers: `--quantization int4` on a float checkpoint, and the 4-bit layers of
GPTQ, AWQ and compressed-tensors checkpoints (formats.py decodes those into the same form).

A layer's weight is held as 4-bit values q (0-15) per group of input channels of each output:
w = scale * (q - zero) + offset, the scale (and offset) fp16 per group and output, the zero point an
integer per group and output (asymmetric GPTQ, AWQ) or one for every weight (8: symmetric formats;
0: `--quantization int4`, whose groups of 32 are affine, an fp16 offset each, as llama.cpp's Q4_1
blocks). A checkpoint quantized with act order (GPTQ's g_idx) has its inputs permuted at load so that
each group's inputs lie together, and each step's activations are permuted the same way.

On tokenmill's CPU kernels (kernels/csrc/cpu/int4_linear.cpp) the values are packed two a byte into
the panels of the panel GEMM and unpacked in registers as they stream (half a byte per weight read at
batch-1 decode), times the activations rounded to int16 per group, as int8 layers compute; the
decoder layers fused in C++ take them too. Elsewhere (a GPU, no compiler) the weight is widened to
the activations' dtype per call.

`--quantization int4`'s groups: of 32 inputs, each group's (scale, offset) the least-error pair of a
few candidates: min-max (the 16 levels from the group's least to its largest weight), narrower
ranges, and each one's least-squares refit (`affine_groups`). A checkpoint that is itself dequantized
from 4-bit GGUF blocks of 32 (SmolLM2's Q4_1) is reproduced exactly by the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.models.layers.linear import CheckpointTensors, FusedProjection, Linear, LinearMethod, stored
from tokenmill.models.layers.quantization.int8 import panels

GROUP_SIZE = 32


def group_size_for(in_features: int) -> int:
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else in_features


_CHUNK = 1 << 16  # groups searched at once (affine_groups)
# Range shrinks tried for each group (besides min-max): the levels spread over a narrower range,
# clipping outliers, then refit.
_SHRINKS = (1.0, 0.9)


@dataclass
class Int4Weight:
    """A layer's 4-bit weight in the form the kernels take: values [out, in] (uint8, 0-15), scales
    [out, groups] (fp16), zero points [out, groups] (uint8) or one for all, offsets [out, groups]
    (fp16) or none, and the input permutation of act order (or none)."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    zero: int
    offsets: torch.Tensor | None
    perm: torch.Tensor | None

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [out, in] (inputs in the permuted order)."""
        n, k = self.values.shape
        groups = self.scales.shape[1]
        size = k // groups
        q = self.values.float().view(n, groups, size)
        zeros = (
            self.zeros.float()
            if self.zeros is not None
            else torch.full((n, groups), float(self.zero), device=self.values.device)
        )[..., None]
        w = (q - zeros) * self.scales.float()[..., None]
        if self.offsets is not None:
            w = w + self.offsets.float()[..., None]
        return w.view(n, k)


def affine_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """`--quantization int4` of a float weight [out, in]: per group, q = round((w - offset) / scale)
    in 0-15 with the (scale, offset) pair of least squared error among the candidates (see the
    module docstring), both fp16. On CPU one C++ pass (kernels/csrc/cpu/quantize.cpp, the groups
    spread over the threads); elsewhere the same search in torch ops, a chunk of groups at a time."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(-1, group_size)
    if cpu_kernels_available(groups.device):
        values, scales, offsets = ops.int4_affine_groups(groups)
    else:
        values = torch.empty(groups.shape, dtype=torch.uint8, device=groups.device)
        scales = torch.empty(groups.shape[0], dtype=torch.float16, device=groups.device)
        offsets = torch.empty(groups.shape[0], dtype=torch.float16, device=groups.device)
        for start in range(0, groups.shape[0], _CHUNK):
            chunk = slice(start, start + _CHUNK)
            values[chunk], scales[chunk], offsets[chunk] = _best_affine(groups[chunk])
    return Int4Weight(
        values.view(n, k), scales.view(n, k // group_size), None, 0, offsets.view(n, k // group_size), None
    )


def _best_affine(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo, hi = g.amin(dim=1), g.amax(dim=1)
    best_error = torch.full(lo.shape, float("inf"), device=g.device)
    best = (
        torch.zeros(g.shape, dtype=torch.uint8, device=g.device),
        torch.zeros_like(lo, dtype=torch.float16),
        lo.half(),
    )
    middle = (lo + hi) / 2
    for shrink in _SHRINKS:
        low = middle - (middle - lo) * shrink
        scale = ((hi - lo) * shrink / 15).clamp(min=1e-8)
        for s, m in ((scale, low), _refit(g, scale, low)):
            s16, m16 = s.half(), m.half()
            q = _levels(g, s16, m16)
            error = ((q.float() * s16.float()[:, None] + m16.float()[:, None]) - g).square().sum(dim=1)
            error = torch.where(torch.isfinite(error), error, float("inf"))
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best = (
                torch.where(better[:, None], q, best[0]),
                torch.where(better, s16, best[1]),
                torch.where(better, m16, best[2]),
            )
    return best


def _levels(g: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    s = scale.float().clamp(min=torch.finfo(torch.float16).tiny)[:, None]
    return torch.round((g - offset.float()[:, None]) / s).clamp(0, 15).to(torch.uint8)


def _refit(g: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares (scale, offset) of a group's values for the levels (scale, offset) gives them."""
    q = _levels(g, scale, offset).float()
    q_mean, w_mean = q.mean(dim=1), g.mean(dim=1)
    spread = (q - q_mean[:, None]).square().sum(dim=1)
    slope = ((q - q_mean[:, None]) * (g - w_mean[:, None])).sum(dim=1) / spread.clamp(min=1e-12)
    slope = torch.where(spread > 0, slope, scale)
    return slope.clamp(min=1e-8), w_mean - slope * q_mean


def pack_values(values: torch.Tensor, width: int) -> torch.Tensor:
    """4-bit values [out, in] as the kernel's panels [panels, in / 2, width] (int4_linear.cpp): each
    byte i of a pair row holds value i (low nibble) and value width + i (high) of the int8 layout."""
    pairs = panels(values, width).view(-1, values.shape[1] // 2, 2, width).transpose(2, 3)  # [p, j, c, t]
    rows = pairs.reshape(pairs.shape[0], pairs.shape[1], 2 * width)  # value 2c + t of each pair row
    return (rows[..., :width] | (rows[..., width:] << 4)).contiguous()


def pack_zeros(zeros: torch.Tensor, width: int) -> torch.Tensor:
    """Zero points [out, groups] as [panels, groups, 2 * width] int8: each column's twice, as its pairs lie."""
    return panels(zeros.to(torch.int8), width).repeat_interleave(2, dim=2)


class Int4Source(CheckpointTensors, Protocol):
    """A format's method (formats.py, gguf.py): declares a layer's checkpoint tensors and decodes them
    into an Int4Weight."""

    def decode_int4(self, layer: Linear) -> Int4Weight: ...


class Int4LinearMethod(LinearMethod):
    """4-bit weight-only (see the module docstring). `source` gives the layer's Int4Weight from its
    loaded tensors: quantized here (`--quantization int4`) or decoded from a checkpoint's
    (formats.py); `kernels`: tokenmill's CPU kernels compute it."""

    name = "int4"

    def __init__(self, kernels: bool, source: Int4Source | None = None) -> None:
        self.kernels = kernels
        self.source = source
        self.tensor_names = source.tensor_names if source is not None else ("weight",)

    def create_weights(self, layer: Linear) -> None:
        if self.source is None:
            super().create_weights(layer)
        else:
            self.source.create_weights(layer)

    def int4_weight(self, layer: Linear) -> Int4Weight:
        if self.source is not None:
            return self.source.decode_int4(layer)
        return affine_groups(layer.weight, group_size_for(layer.in_features))

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        if not self.kernels or self.source is not None:  # (a checkpoint's layers: their own tensors)
            return []
        width = ops.linear_panel_width()
        count, groups = -(-layer.out_features // width), layer.in_features // group_size_for(layer.in_features)
        scales = (count * groups * width, torch.float16)
        return [(count * layer.in_features // 2 * width, torch.uint8), scales, scales]

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = self.int4_weight(layer)
        for name in self.tensor_names:
            delattr(layer, name)
        layer.perm, layer.zero = weight.perm, weight.zero
        # (fp16 scales and offsets: a checkpoint's fp32 or out-of-range ones stay on the widening path)
        exact = all(
            t is None or t.dtype == torch.float16 or torch.equal(t.half().float(), t.float())
            for t in (weight.scales, weight.offsets)
        )
        layer.int4_kernel = self.kernels and exact and layer.in_features % 2 == 0
        if not layer.int4_kernel:
            layer.int4 = weight
            return
        width = ops.linear_panel_width()
        layer.qweight = stored(storage, 0, pack_values(weight.values, width))
        layer.scales = stored(storage, 1, panels(weight.scales.half(), width))
        layer.zeros = pack_zeros(weight.zeros, width) if weight.zeros is not None else None
        offsets = None if weight.offsets is None else panels(weight.offsets.half(), width)
        layer.offsets = None if offsets is None else stored(storage, 2, offsets)

    def _inputs(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return x if layer.perm is None else x.index_select(-1, layer.perm)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x = self._inputs(layer, x)
        if layer.int4_kernel:
            return ops.packed_int4_linear(
                x, layer.qweight, layer.scales, layer.zeros, layer.zero, layer.offsets, layer.bias, layer.out_features
            )
        out = nn.functional.linear(x, layer.int4.dequantized().to(x.dtype))
        return out + layer.bias if layer.bias is not None else out

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.int4_kernel:
            return ops.packed_int4_logits(
                self._inputs(layer, x),
                layer.qweight,
                layer.scales,
                layer.zeros,
                layer.zero,
                layer.offsets,
                layer.bias,
                layer.out_features,
            )
        return self.apply(layer, x).float()

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The weight in the checkpoint's input order."""
        weight = self._unpacked(layer) if layer.int4_kernel else layer.int4
        w = weight.dequantized()
        if layer.perm is not None:
            w = w[:, torch.argsort(layer.perm)]
        return w.to(dtype)

    def _unpacked(self, layer: Linear) -> Int4Weight:
        n, k = layer.out_features, layer.in_features
        panels, pairs, width = layer.qweight.shape
        rows = torch.cat([layer.qweight & 0x0F, layer.qweight >> 4], dim=2)  # value 2c + t of each pair row
        values = rows.view(panels, pairs, width, 2).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:n, :k]

        def unpanel(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]

        zeros = None if layer.zeros is None else unpanel(layer.zeros[:, :, ::2])
        offsets = None if layer.offsets is None else unpanel(layer.offsets)
        return Int4Weight(values, unpanel(layer.scales), zeros, layer.zero, offsets, layer.perm)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        if layer.int4_kernel and layer.perm is None and activations in (torch.float32, torch.bfloat16):
            return FusedProjection(
                layer.qweight, layer.scales, layer.bias, zeros=layer.zeros, offsets=layer.offsets, zero=layer.zero
            )
        return None

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        held = (
            (layer.qweight, layer.scales, layer.zeros, layer.offsets)
            if layer.int4_kernel
            else (layer.int4.values, layer.int4.scales, layer.int4.zeros, layer.int4.offsets)
        )
        return [t for t in held if t is not None]
