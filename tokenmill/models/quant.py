"""Weight-only int8 quantization of the linear layers (group-wise scales).

Every linear layer of the decoder stack keeps its weight as int8 with one fp32 scale per group of
32 input channels of each output row (per output channel when the width is not a multiple of 32);
activations stay in the model dtype. The lm_head and the embeddings are not quantized: they decide
the next token directly, and their error is what flips near-tied top-1 choices.

Why not w8a8 (torch.ao dynamic quantization, the previous CPU path): its activations are quantized
per tensor, over the whole batch, so one outlier token costs every row its precision (and a request's
tokens depend on its batch): teacher-forced top-1 agreement with fp32 on SmolLM2 was 49%, against
98% for this scheme (`tokenmill bench agreement`).

On CPU the product runs on tokenmill's panel GEMM (`tokenmill.kernels`, packed_linear.cpp: 1 byte per
weight streamed, multiplied with the activations rounded to int16 per group (under 1/65534 of the
group's largest value: far finer than bf16) in exact int32 sums, fp32 across groups); without it (no
compiler, a GPU) the weight is widened to the activation dtype per call.
MoE expert weights are split into one linear per expert first and quantized the same way; MoE
routers are not linear layers and stay in the model dtype (int8 routing would pick other experts).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.models.moe import split_experts
from tokenmill.models.packed_linear import PanelLinear, into_huge_pages, packing_for

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
_KEPT = ("lm_head",)  # linear layers (by attribute name) kept in the model dtype


def group_size_for(in_features: int) -> int:
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else in_features


def quantize_weight(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scales [N, K / group_size]): symmetric, round to nearest."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    scales = groups.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k).contiguous(), scales.contiguous()


class WeightOnlyInt8Linear(nn.Module):
    """On CPU with tokenmill's kernels the int8 weight and its scales are packed into the panels of
    the panel GEMM (kernels/csrc/packed_linear.cpp: the weight by pairs of inputs, for int16 pair
    products); elsewhere they stay [N, K] and [N, K / group_size] and are widened per call."""

    def __init__(self, linear: nn.Linear, use_cpu_kernel: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size_for(linear.in_features)
        qweight, scales = quantize_weight(linear.weight, self.group_size)
        self.use_cpu_kernel = use_cpu_kernel and qweight.device.type == "cpu"
        if self.use_cpu_kernel:
            qweight = torch.ops.tokenmill.pack_int8_weight(qweight)
            scales = torch.ops.tokenmill.pack_linear_weight(scales)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = linear.bias

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [N, K], fp32 scales [N, K / group_size]), unpacked from the panels if packed."""
        if not self.use_cpu_kernel:
            return self.qweight, self.scales
        n, k = self.out_features, self.in_features
        panels, pairs, width = self.qweight.shape  # [panels, pairs of k, 2 * panel]: a pair's columns side by side
        qweight = self.qweight.view(panels, pairs, width // 2, 2).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:n, :k]
        return qweight, self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[:n]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        qweight, scales = self.quantized()
        n, k = qweight.shape
        groups = qweight.reshape(n, k // self.group_size, self.group_size).to(dtype)
        return (groups * scales[..., None].to(dtype)).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel:
            return torch.ops.tokenmill.packed_int8_linear(x, self.qweight, self.scales, self.bias, self.out_features)
        out = nn.functional.linear(x, self.dequantized(x.dtype))
        return out + self.bias if self.bias is not None else out


def quantize_model(model: nn.Module, method: str) -> None:
    if method != "int8":
        raise ValueError(f"unsupported quantization {method!r}; supported: int8")
    from tokenmill.kernels.ops import cpu_kernels_available

    split_experts(model)
    device = next(model.parameters()).device
    use_kernel = cpu_kernels_available(device)
    if device.type == "cpu" and not use_kernel:
        logger.warning("int8 without tokenmill's CPU kernels: weights are widened on every call (slow)")
    before = _linear_bytes(model)
    _replace_linears(model, use_kernel)
    if use_kernel:
        _into_huge_pages([m for m in model.modules() if isinstance(m, WeightOnlyInt8Linear)])
    after = _linear_bytes(model)
    logger.info("int8 weights (groups of %d, lm_head and embeddings kept): linear layers %.1f MiB -> %.1f MiB",
                GROUP_SIZE, before / 2**20, after / 2**20)


@torch.no_grad()
def head_to_bf16(model: nn.Module) -> int:
    """Before pack_linears: the fp32 layers int8 keeps (the lm_head) rounded to bf16 values, where the
    panel GEMM takes bf16 weights under fp32 activations (CPUs without native bf16), so that packing
    holds them in bf16 panels (packed_linear.panel_dtype); returns how many. Half the bytes of the
    largest matrix a decode step streams (SmolLM2: 113 -> 57 MB, batch-1 int8 11.0-11.9 -> 9.4
    ms/step). A tied embedding shares the rounded matrix and reads the head's panels (one copy, its
    rows returned in fp32). Agreement: `tokenmill bench agreement --quantization int8 --references
    float32 bfloat16` (bench/README.md)."""
    if packing_for(torch.empty(0, dtype=torch.bfloat16)) is not PanelLinear:
        return 0
    heads = [child for module in model.modules() for name, child in module.named_children()
             if name in _KEPT and type(child) is nn.Linear and packing_for(child.weight) is PanelLinear]
    for head in heads:
        head.weight.copy_(head.weight.to(torch.bfloat16))
    if heads:
        logger.info("int8: the lm_head held in bf16 (widened to fp32 as it streams)")
    return len(heads)


def _into_huge_pages(layers: list[WeightOnlyInt8Linear]) -> None:
    """Every layer's packed int8 weight and scales moved into one huge-page buffer (as
    pack_linears does for fp32 panels: a decode step streams them all)."""
    moved = into_huge_pages([t for layer in layers for t in (layer.qweight, layer.scales)])
    for layer, qweight, scales in zip(layers, moved[0::2], moved[1::2]):
        layer.qweight, layer.scales = qweight, scales


def _replace_linears(module: nn.Module, use_kernel: bool) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and name not in _KEPT:
            setattr(module, name, WeightOnlyInt8Linear(child, use_kernel))
        else:
            _replace_linears(child, use_kernel)


def _linear_bytes(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, WeightOnlyInt8Linear):
            total += m.qweight.numel() + m.scales.numel() * m.scales.element_size()
    return total
