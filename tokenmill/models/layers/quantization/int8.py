"""Weight-only int8 linear layers: `--quantization int8`, and the 8-bit layers of checkpoints (GPTQ's
symmetric 8-bit, compressed-tensors W8A16) with their own values and scales (formats.py decodes those
into the same form: int8 values, a scale per group of inputs of each output, act order's input
permutation).

Every layer keeps its weight as int8 with one scale per group of 32 input channels of each output row
(per output channel when the width is not a multiple of 32); activations stay in the model dtype. On
tokenmill's CPU kernels that includes the lm_head, the largest matrix a decode step streams (SmolLM2:
57 MB in bf16, 30 MB in int8 with its scales), and an embedding tied to it reads its rows from the int8
head (Int8Embedding: one copy). Its groups of 32 keep the head as close to fp32 as a bf16 head, and
least-error scales (`group_scales`) bring the whole model closer still (teacher-forced top-1
agreement: `tokenmill bench agreement`, bench/README.md). Without the kernels (a GPU) the
head stays in the model dtype: there int8 weights are widened on every call, which would cost a
vocabulary-sized matrix per step.

Why not w8a8 (torch.ao dynamic quantization): its activations are quantized
per tensor, over the whole batch, so one outlier token costs every row its precision (and a request's
tokens depend on its batch): its teacher-forced top-1 agreement with fp32 is far below this
scheme's (`tokenmill bench agreement`).

On CPU the product runs on tokenmill's panel GEMM (kernels/csrc/cpu/int8_linear.cpp: 1 byte per weight
streamed, multiplied with the activations rounded to int16 per group (under 1/65534 of the group's
largest value: far finer than bf16) in exact int32 sums, fp32 across groups); without it (no
compiler, a GPU) the weight is widened to the activation dtype per call. On CPUs with AMX, larger
steps run on its tiles from the same packed weight: an fp32 model's (16 rows and more) as the same
int32 sums on AMX-int8 (the same bits), a bf16 model's (12 rows and more) as the weights widened to
bf16 (q * scale, rounded once) on AMX-bf16, its activations being bf16 already
(bench/amx_int8_vs_panels.py).
MoE expert weights are split into one linear layer per expert first and quantized the same way; MoE
routers are not linear layers and stay in the model dtype (int8 routing would pick other experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.models.layers.linear import CheckpointTensors, FusedProjection, Linear, LinearMethod, stored

GROUP_SIZE = 32
SCALE_CANDIDATES = 128  # bf16 scales tried per group: from round-to-nearest's up to twice it (group_scales)
# Groups searched at once by the torch version: on a GPU large chunks (a 7B model's 2e8 groups in
# ~200 chunks of 128 candidates), on a CPU without tokenmill's kernels chunks that stay in cache.
_CPU_SEARCH_CHUNK, _GPU_SEARCH_CHUNK = 1 << 14, 1 << 20


def group_size_for(in_features: int) -> int:
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else in_features


def quantize_weight(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], bf16 scales [N, K / group_size]): symmetric, round to nearest, each group's scale
    the bf16 value of least squared error from its largest magnitude / 127 (rounded up: no weight
    clips) up to twice that (`group_scales`)."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    scales = group_scales(groups.reshape(-1, group_size)).view(n, k // group_size)
    q = torch.round(groups / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k).contiguous(), scales.contiguous()


def group_scales(groups: torch.Tensor, candidates: int = SCALE_CANDIDATES) -> torch.Tensor:
    """bf16 scales [G] of fp32 groups [G, size]: of `candidates` consecutive bf16 values from the
    round-to-nearest scale up, the one whose int8 values reproduce the group with the least squared
    error (ties: the smaller). A larger step than max|w| / 127 wins where the weights sit on a
    coarser grid than int8's: SmolLM2's checkpoint is dequantised from 4-bit GGUF blocks (16 levels
    a block), whose levels a matching step reproduces nearly exactly (agreement with fp32: `tokenmill
    bench agreement`; the ceiling any int8 scheme reaches: `python bench/int8_agreement_ceiling.py`).
    On CPU one C++ pass (kernels/csrc/cpu/quantize.cpp); elsewhere the same search in torch ops."""
    if cpu_kernels_available(groups.device):
        return ops.int8_group_scales(groups.contiguous(), candidates)
    scales = torch.empty(groups.shape[0], dtype=torch.bfloat16, device=groups.device)
    chunk = _CPU_SEARCH_CHUNK if groups.device.type == "cpu" else _GPU_SEARCH_CHUNK
    for start in range(0, groups.shape[0], chunk):
        g = groups[start : start + chunk]
        first = round_up_to_bf16(g.abs().amax(dim=-1).clamp(min=1e-8) / 127.0).view(torch.int16)
        best_error = torch.full(first.shape, float("inf"), device=g.device)
        best = first.view(torch.bfloat16)
        for j in range(candidates):
            scale = (first + j).view(torch.bfloat16)
            s = scale.float()[:, None]
            error = (torch.round(g / s).clamp(-127, 127) * s - g).square().sum(dim=-1)
            error = torch.where(torch.isfinite(s[:, 0]), error, float("inf"))
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best = torch.where(better, scale, best)
        scales[start : start + chunk] = best
    return scales


def round_up_to_bf16(values: torch.Tensor) -> torch.Tensor:
    """Positive finite fp32 values as the least bf16 values not below them."""
    rounded = values.to(torch.bfloat16)
    below = rounded.float() < values
    # (the next bf16 above a positive one is its bit pattern plus one)
    return torch.where(below, (rounded.view(torch.int16) + 1).view(torch.bfloat16), rounded)


@dataclass
class Int8Weight:
    """A layer's int8 weight: values [out, in] (int8), scales [out, groups] (one per group of in /
    groups consecutive inputs), and the input permutation of act order (or none)."""

    values: torch.Tensor
    scales: torch.Tensor
    perm: torch.Tensor | None = None


class Int8Source(CheckpointTensors, Protocol):
    """A format's method (formats.py, gguf.py): declares a layer's checkpoint tensors and decodes them
    into an Int8Weight."""

    def decode_int8(self, layer: Linear) -> Int8Weight: ...


# Scale dtypes the int8 kernels take as they are (int8_linear.cpp): tokenmill's bf16, checkpoints' fp16.
_KERNEL_SCALES = (torch.bfloat16, torch.float16)


def kernel_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """A checkpoint's scales (read as fp32) in a dtype the kernels take that holds them exactly, or
    None (they stay on the widening path)."""
    if scales.dtype in _KERNEL_SCALES:
        return scales
    for dtype in (torch.float16, torch.bfloat16):
        narrowed = scales.to(dtype)
        if torch.equal(narrowed.float(), scales.float()):
            return narrowed
    return None


def panels(t: torch.Tensor, width: int) -> torch.Tensor:
    """[out, cols] as [panels, cols, width] (output columns past `out` zero), as pack_linear_weight
    lays out a weight; for per-group tensors (scales, offsets, zero points) of any dtype."""
    n, cols = t.shape
    count = -(-n // width)
    padded = t.new_zeros(count * width, cols)
    padded[:n] = t
    return padded.view(count, width, cols).transpose(1, 2).contiguous()


class Int8LinearMethod(LinearMethod):
    """Weight-only int8: a float weight quantized at load, or (`source`: a format's method, see
    formats.py) a checkpoint's own int8 values and scales. With tokenmill's kernels (`kernels`) the
    values and scales are packed into the panels of the panel GEMM (the weight by pairs of inputs, for
    int16 pair products; `layer.qweight`, `layer.scales`); elsewhere, or for a checkpoint's scales the
    kernels do not take (fp32 ones that are neither fp16 nor bf16 values), they stay [N, K] and
    [N, K / group_size] and are widened per call."""

    name = "int8"

    def __init__(self, kernels: bool, source: Int8Source | None = None) -> None:
        self.kernels = kernels
        self.source = source
        self.tensor_names = source.tensor_names if source is not None else ("weight",)

    def create_weights(self, layer: Linear) -> None:
        if self.source is None:
            super().create_weights(layer)
        else:
            self.source.create_weights(layer)

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        if not self.kernels or self.source is not None:  # (a checkpoint's layers: their own tensors)
            return []
        width = ops.linear_panel_width()
        count = -(-layer.out_features // width)
        groups = layer.in_features // group_size_for(layer.in_features)
        return [
            (count * ((layer.in_features + 1) // 2) * 2 * width, torch.int8),
            (count * groups * width, torch.bfloat16),
        ]

    def int8_weight(self, layer: Linear) -> Int8Weight:
        if self.source is not None:
            return self.source.decode_int8(layer)
        return Int8Weight(*quantize_weight(layer.weight, group_size_for(layer.in_features)))

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = self.int8_weight(layer)
        for name in self.tensor_names:
            delattr(layer, name)
        layer.group_size = layer.in_features // weight.scales.shape[1]
        layer.perm = weight.perm
        # (the kernel's int16 pairs of inputs lie within a group: even groups, or one)
        pairs_fit = weight.scales.shape[1] == 1 or layer.group_size % 2 == 0
        scales = kernel_scales(weight.scales) if self.kernels and pairs_fit else None
        layer.int8_kernel = scales is not None
        qweight = weight.values
        if scales is not None:
            width = ops.linear_panel_width()
            qweight = stored(storage, 0, ops.pack_int8_weight(qweight))
            scales = stored(storage, 1, panels(scales, width))
        layer.qweight, layer.scales = qweight, weight.scales if scales is None else scales

    def quantized(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [N, K], scales [N, K / group_size]), unpacked from the panels if packed (inputs in
        the kernel's order: act order's permutation applied)."""
        if not layer.int8_kernel:
            return layer.qweight, layer.scales
        n, k = layer.out_features, layer.in_features
        count, pairs, width = layer.qweight.shape  # [panels, pairs of k, 2 * panel]: a pair's columns side by side
        qweight = layer.qweight.view(count, pairs, width // 2, 2).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:n, :k]
        return qweight, layer.scales.transpose(1, 2).reshape(-1, layer.scales.shape[1])[:n]

    def _permuted(self, layer: Linear) -> torch.Tensor:
        """The weight [N, K] in the kernel's input order, fp32."""
        qweight, scales = self.quantized(layer)
        n, k = qweight.shape
        groups = qweight.reshape(n, k // layer.group_size, layer.group_size).float()
        return (groups * scales[..., None].float()).view(n, k)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The weight in the checkpoint's input order (each value times its scale, exact in fp32)."""
        w = self._permuted(layer)
        if layer.perm is not None:
            w = w[:, torch.argsort(layer.perm)]
        return w.to(dtype)

    def _inputs(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return x if layer.perm is None else x.index_select(-1, layer.perm)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x = self._inputs(layer, x)
        if layer.int8_kernel:
            return ops.packed_int8_linear(x, layer.qweight, layer.scales, layer.bias, layer.out_features)
        out = nn.functional.linear(x, self._permuted(layer).to(x.dtype))
        return out + layer.bias if layer.bias is not None else out

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """On CPU the kernel's fp32 sums, not rounded to x's dtype first."""
        if layer.int8_kernel:
            x = self._inputs(layer, x)
            return ops.packed_int8_logits(x, layer.qweight, layer.scales, layer.bias, layer.out_features)
        return self.apply(layer, x).float()

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        if layer.int8_kernel and layer.perm is None and activations in (torch.float32, torch.bfloat16):
            return FusedProjection(layer.qweight, layer.scales, layer.bias)
        return None

    def tied_embedding(self, layer: Linear, embedding: nn.Embedding) -> nn.Module | None:
        return Int8Embedding(embedding, layer) if layer.int8_kernel and layer.perm is None else None

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.qweight, layer.scales]


class Int8Embedding(nn.Module):
    """The token embedding of a model whose lm_head shares (ties) its matrix, read from the head's
    packed int8 weight and scales: row v is column v % width of panel v // width (its int8 values by
    pairs of inputs, see Int8LinearMethod), times its scales, in the embedding's dtype. Equal to the
    head's dequantized rows; one copy of the vocabulary matrix instead of two."""

    def __init__(self, embedding: nn.Embedding, head: Linear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.dtype = embedding.weight.dtype
        self.head = [head]  # (a list: not a submodule, so the head's tensors are counted once, at the head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        # (one C++ call instead of ~10 torch ops, each with its dispatch cost, in a batch-1 step)
        return ops.packed_int8_rows(ids, head.qweight, head.scales, self.embedding_dim, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the int8 lm_head"
