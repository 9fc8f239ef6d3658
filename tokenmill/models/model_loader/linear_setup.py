"""Linear layers' methods at load: picked before the checkpoint is read (`linear_backend`,
`assign_linear_methods`), their tensors laid out once it is (`process_weights_after_loading`).
See models/layers/linear.py for what a method is."""

from __future__ import annotations

import itertools
import logging
import mmap
from collections import Counter

import torch
from torch import nn

from tokenmill.kernels.cpu_caps import detect
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.models.layers.fixed_shapes import FixedRowsMethod
from tokenmill.models.layers.linear import UNQUANTIZED, Linear, LinearBackend, LinearMethod, PartNames, linear_layers
from tokenmill.models.layers.moe import GroupedExperts, split_experts
from tokenmill.models.layers.packed_linear import PANELS, packed_method_for
from tokenmill.models.layers.quantization import QuantizationConfig

logger = logging.getLogger(__name__)


def linear_backend(
    device: torch.device, dtype: torch.dtype, packed: bool, batch_invariant: bool = False
) -> LinearBackend:
    """How float layers run on `device` in `dtype`: packed for tokenmill's CPU kernels or oneDNN
    (`packed`: `--packed-linear` on CPU, not under --compile) or torch's GEMMs. `batch_invariant`: on
    methods whose rows do not depend on their step: tokenmill's row-invariant kernels, or where they
    do not run, every method on fixed-size chunks of rows."""
    packed_method = packed_method_for(dtype, batch_invariant) if packed and device.type == "cpu" else None
    float_method = packed_method or UNQUANTIZED
    kernels = cpu_kernels_available(device)
    head_method = _head_method(float_method, dtype, kernels)
    return LinearBackend(device, dtype, float_method, head_method, kernels, batch_invariant and not kernels)


def _head_method(float_method: LinearMethod, dtype: torch.dtype, kernels: bool) -> LinearMethod:
    """The lm_head's float method: the layers' one, except a bf16 head that oneDNN would compute
    without AMX tiles (AVX512-BF16 CPUs): oneDNN rounds that GEMM's output to bf16, and bf16 logits
    tie and swap near-equal tokens. The panel GEMM returns the head's fp32 sums from the same bf16
    weight (a head computes one row per sequence: the bytes streamed are the same)."""
    onednn_bf16 = float_method.name == "onednn" and dtype == torch.bfloat16
    if onednn_bf16 and kernels and not detect().amx_bf16 and detect().vector_isa != "generic":
        return PANELS
    return float_method


def assign_linear_methods(
    model: nn.Module, backend: LinearBackend, quantization: QuantizationConfig | None, parts: PartNames
) -> None:
    """Give every linear layer its method (before the checkpoint is read): the quantization's for the
    layers it covers, the backend's float method for the rest. `parts`: the checkpoint module names
    of each layer (several for a fused layer), which the quantization's per-module rules match."""
    float_method, head_method = backend.float_method(), backend.head_method()
    for name, layer in linear_layers(model):
        layer.name = name  # (errors about its tensors name it)
        method = quantization.linear_method(name, parts.get(name, (name,)), layer, backend) if quantization else None
        method = method or (head_method if name.rpartition(".")[2] == "lm_head" else float_method)
        layer.use_method(FixedRowsMethod(method) if backend.fixed_rows else method)
    for module in model.modules():
        if isinstance(module, GroupedExperts):  # (stacked: split into linear layers once loaded)
            module.linear_method = quantization.expert_method() if quantization else None


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Every linear layer's loaded tensors turned into its method's layout. The tensors steps stream
    share one huge-page buffer (see huge_page_buffer), and an embedding whose table is tied to a
    layer whose method can read rows from its own layout reads them there (one copy of the matrix).
    Quantized experts of a mixture of experts become linear layers of their own first."""
    split_experts(model)
    layers = [layer for _, layer in linear_layers(model)]
    tied_by_weight = {id(layer.weight): layer for layer in layers if "weight" in layer.quant_method.tensor_names}
    sizes = [layer.quant_method.packed_sizes(layer) for layer in layers]
    starts = _aligned_starts([numel * dtype.itemsize for layer_sizes in sizes for numel, dtype in layer_sizes])
    buffer = huge_page_buffer(starts[-1]) if starts[-1] else None
    offsets = iter(starts)
    for layer, layer_sizes in zip(layers, sizes):
        storage = [] if buffer is None else [_view(buffer, next(offsets), numel, dtype) for numel, dtype in layer_sizes]
        layer.quant_method.process_weights_after_loading(layer, storage)
    tied = _read_tied_embeddings(model, tied_by_weight)  # (a tied table lives on in its embedding: its id holds)
    counts = Counter(layer.quant_method.describe(layer) for layer in layers)
    if tied:
        counts[f"embedding read from the {tied} head"] += 1
    logger.info("linear layers: %s", ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none")


def _read_tied_embeddings(model: nn.Module, heads: dict[int, Linear]) -> str:
    """Replace an nn.Embedding whose table one of `heads` was loaded from by the head's method's reader
    (the float table then goes with the embedding); the head's method name, or '' if none."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            head = heads.get(id(child.weight)) if type(child) is nn.Embedding else None
            if head is None or child.max_norm is not None or head.bias is not None:
                continue
            reader = head.quant_method.tied_embedding(head, child)
            if reader is not None:
                setattr(module, name, reader)
                return head.quant_method.name
    return ""


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of (uint8) memory, advised for transparent huge pages where the OS offers them.
    A decode step streams every weight once: with 4 KiB pages that is a TLB miss, and a stop of the
    hardware prefetcher, every 1,024 floats (2 MiB pages make one row's pass over the layers' panel
    GEMMs faster: `tokenmill bench kernels`, its table of the model's layer GEMMs)."""
    try:
        region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # no THP (or no madvise) here: ordinary pages
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # keeps `region` alive


# Offsets of tensors in a shared huge-page buffer are multiples of this many bytes (a cache line).
_ALIGN_BYTES = 64


def _aligned_starts(nbytes: list[int]) -> list[int]:
    return list(itertools.accumulate((-(-n // _ALIGN_BYTES) * _ALIGN_BYTES for n in nbytes), initial=0))


def _view(buffer: torch.Tensor, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` values of `dtype` at byte `start` of a uint8 buffer."""
    return buffer[start : start + numel * dtype.itemsize].view(dtype)
