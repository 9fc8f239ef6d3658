"""Linear layers and the methods that hold and multiply their weights (vLLM's `quant_method`).

Every linear layer of a model is a `Linear`, and every `Linear` has one `LinearMethod`, chosen once at
load time, before the checkpoint is read (`assign_linear_methods`): the method declares the tensors the
checkpoint fills (`create_weights`: a float `weight`, or a format's packed integers, scales and zero
points), turns them into the layout its kernel reads once they are loaded
(`process_weights_after_loading`), and computes the layer (`apply`, and `logits` for a vocabulary
projection). The choice is made by the checkpoint's quantization (`quantization.QuantizationConfig`,
from config.json's `quantization_config` or `--quantization`) and, for layers left in float, by
`LinearBackend` (the device, the dtype, the CPU's features and `--packed-linear`). Code that needs to
know how a layer computes (the fused decoder layers, LoRA, the tied embedding, the roofline) asks its
method, never its class.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenmill.models.layers.quantization import QuantizationConfig

logger = logging.getLogger(__name__)

# TOKENMILL_LM_HEAD=linear: a plain CPU head through F.linear instead of the vocab-major product
# (for A/B measurements).
_LM_HEAD_MODE = os.environ.get("TOKENMILL_LM_HEAD", "auto")


class Linear(nn.Module):
    """y = x W^T + b, held and computed by `quant_method`. Built with the unquantized method (a float
    `weight` [out, in], as nn.Linear); the loader may give it another before the weights are read."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method: LinearMethod = UNQUANTIZED
        UNQUANTIZED.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Linear:
        """A Linear sharing an nn.Linear's parameters (the generic path's HF modules)."""
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features)
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def use_method(self, method: LinearMethod) -> None:
        """Hold the weight as `method` does (before loading: the tensors it declares replace the
        float weight)."""
        if method.tensor_names == self.quant_method.tensor_names:  # (float weights either way: kept)
            self.quant_method = method
            return
        for name in self.quant_method.tensor_names:
            delattr(self, name)
        self.quant_method = method
        method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # e.g. [1, T, in] from HF modules (the generic path): rows are rows
            return self.quant_method.apply(self, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return self.quant_method.apply(self, x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, out_features] of x [rows, in_features] (this layer as the vocabulary
        projection). A method whose kernel sums in fp32 returns those sums unrounded: bf16 logits (8
        significant bits: steps of 1/16 at |logit| 16-32) tie and swap near-equal tokens, the largest
        part of a bf16 model's disagreement with fp32 (SmolLM2, teacher-forced top-1: 97.2% with bf16
        logits, 98.4% with fp32 ones, bench/README.md)."""
        return self.quant_method.logits(self, x)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight this layer multiplies by, in `dtype`."""
        return self.quant_method.dequantized(self, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"method={self.quant_method.describe(self)}"
        )


def linear_parameter(layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype, **layout: int) -> None:
    """Declare a tensor the checkpoint fills (on the layer's current device: meta while loading).
    `layout`: output_dim (the dim fused parts are joined along; none: every part holds the same tensor)."""
    parameter = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    parameter.load_dtype = dtype  # (the loader reads the checkpoint's tensor in this dtype)
    for key, value in layout.items():
        setattr(parameter, key, value)
    setattr(layer, name, parameter)


class LinearMethod:
    """How one layer holds its weight and computes x W^T + b. Methods hold no per-layer state: what
    they make of a layer's tensors lives on the layer."""

    name = "float"
    # The tensors create_weights declares (besides the bias, which every layer owns).
    tensor_names: tuple[str, ...] = ("weight",)

    def create_weights(self, layer: Linear) -> None:
        """Declare the tensors the checkpoint fills: here a float weight [out, in] (in the model's dtype)."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of the tensors process_weights_after_loading will stream every step, so that
        they can be laid out in one huge-page buffer first (`storage`); none by default."""
        return []

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        """Turn the loaded tensors into the layout `apply` reads (`storage`: flat tensors of
        packed_sizes to put them in)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight, layer.bias)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and layer.bias is None and _LM_HEAD_MODE != "linear":
            # A skinny [rows, dim] x [dim, vocab] product runs 1.2-2x faster on CPU BLAS as the
            # vocab-major [vocab, dim] x [dim, rows] (measured: fp32, 49k vocab, 8-128 rows), and the
            # transposed result is a free view. The weight is read in place: no copy of it is kept.
            return torch.mm(layer.weight, x.t()).t().float()
        return self.apply(layer, x).float()

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight this layer multiplies by, in `dtype`."""
        return layer.weight.detach().to(dtype)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        """The layer's tensors as the C++ decoder layers take them (kernels/csrc/cpu/decoder_layer.cpp),
        for `activations` of that dtype, or None when they cannot compute it."""
        return None

    def tied_embedding(self, layer: Linear, embedding: nn.Embedding) -> nn.Module | None:
        """An embedding reading its rows from this layer's held weight (the embedding's table tied to
        it), or None: the embedding keeps its own table."""
        return None

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        """Tensors a step reads that are neither parameters nor buffers (packed weights)."""
        return []

    def describe(self, layer: Linear) -> str:
        return self.name


UNQUANTIZED = LinearMethod()


@dataclass(frozen=True)
class FusedProjection:
    """A projection as the C++ decoder layers take it: the packed weight and, for quantized ones, the
    tensors that go with it (scales; 4-bit ones' zero points, or one for all, and offsets); the bias."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    zeros: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    zero: int = 0

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """In the order decoder_layer.cpp takes a projection's tensors."""
        return self.weight, self.scales, self.zeros, self.offsets, self.bias


@dataclass(frozen=True)
class LinearBackend:
    """How layers left in float run here: the device, the compute dtype, and whether their weights
    are packed for tokenmill's CPU kernels or oneDNN (`--packed-linear`: CPU, not under --compile)."""

    device: torch.device
    dtype: torch.dtype
    packed: bool

    @property
    def kernels(self) -> bool:
        """Whether tokenmill's CPU kernels compute here (quantized layers' packed forms)."""
        from tokenmill.kernels.ops import cpu_kernels_available

        return cpu_kernels_available(self.device)

    def float_method(self) -> LinearMethod:
        if self.packed and self.device.type == "cpu":
            from tokenmill.models.layers.packed_linear import packed_method_for

            return packed_method_for(self.dtype) or UNQUANTIZED
        return UNQUANTIZED

    def head_method(self) -> LinearMethod:
        """The lm_head's float method: the layers' one, except a bf16 head that oneDNN would compute
        without AMX tiles (AVX512-BF16 CPUs): oneDNN rounds that GEMM's output to bf16, and bf16 logits
        tie and swap near-equal tokens. The panel GEMM returns the head's fp32 sums from the same bf16
        weight (a head computes one row per sequence: the bytes streamed are the same)."""
        method = self.float_method()
        if method.name == "onednn" and self.dtype == torch.bfloat16:
            from tokenmill.kernels.cpu_caps import detect
            from tokenmill.models.layers.packed_linear import PANELS

            if not detect().amx_bf16 and detect().vector_isa != "generic" and self.kernels:
                return PANELS
        return method


def linear_layers(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            yield name, module


def assign_linear_methods(
    model: nn.Module, backend: LinearBackend, quantization: QuantizationConfig | None, parts: PartNames
) -> None:
    """Give every linear layer its method (before the checkpoint is read): the quantization's for the
    layers it covers, the backend's float method for the rest. `parts`: the checkpoint module names
    of each layer (several for a fused layer), which the quantization's per-module rules match."""
    from tokenmill.models.layers.moe import GroupedExperts

    float_method, head_method = backend.float_method(), backend.head_method()
    for name, layer in linear_layers(model):
        layer.name = name  # (errors about its tensors name it)
        method = quantization.linear_method(name, parts.get(name, (name,)), layer, backend) if quantization else None
        layer.use_method(method or (head_method if name.rpartition(".")[2] == "lm_head" else float_method))
    for module in model.modules():
        if isinstance(module, GroupedExperts):  # (stacked: split into linear layers once loaded)
            module.linear_method = quantization.expert_method() if quantization else None


# {a local linear layer's name: the checkpoint module names its parts come from}
PartNames = dict[str, tuple[str, ...]]


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    """Every linear layer's loaded tensors turned into its method's layout. The tensors steps stream
    share one huge-page buffer (see huge_page_buffer), and an embedding whose table is tied to a
    layer whose method can read rows from its own layout reads them there (one copy of the matrix).
    Quantized experts of a mixture of experts become linear layers of their own first."""
    from tokenmill.models.layers.moe import split_experts

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
    hardware prefetcher, every 1,024 floats (one row of panel GEMMs over SmolLM2's layers: 1.09x
    faster from 2 MiB pages, 13.1 vs 14.3 ms)."""
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


def stored(storage: list[torch.Tensor], index: int, packed: torch.Tensor) -> torch.Tensor:
    """`packed` in its place in `storage` (when given: see LinearMethod.packed_sizes), else itself."""
    if not storage:
        return packed
    return storage[index].view(packed.shape).copy_(packed)


@torch.no_grad()
def linear_with(linear: nn.Linear, method: LinearMethod) -> Linear:
    """A Linear of `method` on an nn.Linear's weight and bias (left as they are), processed."""
    layer = Linear.from_linear(linear)
    layer.use_method(method)
    method.process_weights_after_loading(layer, [])
    return layer


def replace_linear_modules(model: nn.Module) -> None:
    """Every nn.Linear of a model built by other code (the generic path's HF modules) as a Linear
    holding the same parameters."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Linear.from_linear(child))
