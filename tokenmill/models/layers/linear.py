"""Linear layers and the methods that hold and multiply their weights (vLLM's `quant_method`).

Every linear layer of a model is a `Linear`, and every `Linear` has one `LinearMethod`, chosen once
at load time, before the checkpoint is read (model_loader/linear_setup.py's
`assign_linear_methods`): the method declares the tensors the checkpoint fills (`create_weights`: a
float `weight`, or a format's packed integers, scales and zero points), turns them into the layout
its kernel reads once they are loaded (`process_weights_after_loading`), and computes the layer
(`apply`, and `logits` for a vocabulary projection). The choice is made by the checkpoint's
quantization (`quantization.QuantizationConfig`, from config.json's `quantization_config` or
`--quantization`) and, for layers left in float, by `LinearBackend` (the device, the dtype, the
CPU's features and `--packed-linear`). Code that needs to know how a layer computes (the fused
decoder layers, LoRA, the tied embedding, the roofline) asks its method, never its class.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenmill.models.layers.quantization.int4 import Int4Weight

logger = logging.getLogger(__name__)

# TOKENMILL_LM_HEAD=linear: a plain CPU head through F.linear instead of the vocab-major product
# (for A/B measurements).
_LM_HEAD_MODE = os.environ.get("TOKENMILL_LM_HEAD", "auto")


class Linear(nn.Module):
    """y = x W^T + b, held and computed by `quant_method`. Built with the unquantized method (a float
    `weight` [out, in], as nn.Linear); the loader may give it another before the weights are read."""

    # What the methods hold on a layer: each declares and sets only its own (create_weights: the
    # checkpoint's tensors; process_weights_after_loading: the forms its kernel reads).
    weight: torch.Tensor  # float methods; FP8 and compressed-tensors int8 checkpoints' values
    bias: torch.Tensor | None
    name: str  # in the model (assign_linear_methods): errors about the layer's tensors name it
    # quantized checkpoints' tensors (formats.py, gguf.py)
    qzeros: torch.Tensor
    g_idx: torch.Tensor
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_g_idx: torch.Tensor
    # packed forms (packed_linear.py, quantization/)
    packed_weight: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    offsets: torch.Tensor | None
    column_offsets: torch.Tensor
    zero: int
    group_size: int
    perm: torch.Tensor | None
    int4: Int4Weight  # a 4-bit layer off the kernels
    int4_kernel: bool
    int8_kernel: bool
    native: bool  # oneDNN layers: through tokenmill's C++ op
    amx_decode: bool

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
        part of a bf16 model's disagreement with fp32 (`tokenmill bench agreement --dtype bfloat16`)."""
        return self.quant_method.logits(self, x)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight this layer multiplies by, in `dtype`."""
        return self.quant_method.dequantized(self, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"method={self.quant_method.describe(self)}"
        )


def linear_parameter(
    layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype, **layout: int | None
) -> None:
    """Declare a tensor the checkpoint fills (on the layer's current device: meta while loading).
    `layout`: output_dim (the dim fused parts are joined along; none: every part holds the same tensor)."""
    parameter = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    # (load_dtype: the loader reads the checkpoint's tensor in this dtype)
    for key, value in {"load_dtype": dtype, **layout}.items():
        setattr(parameter, key, value)
    setattr(layer, name, parameter)


class CheckpointTensors(Protocol):
    """What a format's method (formats.py, gguf.py) offers the weight-only methods that decode it:
    the layer's checkpoint tensors, declared on the layer (Int4Source, Int8Source, FP8Source add
    the decoding)."""

    @property
    def tensor_names(self) -> tuple[str, ...]: ...

    def create_weights(self, layer: Linear) -> None: ...


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
            # A skinny [rows, dim] x [dim, vocab] product runs faster on CPU BLAS as the vocab-major
            # [vocab, dim] x [dim, rows] (`tokenmill bench kernels`, the vocabulary projection), and the
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
    tensors that go with it (scales; 4-bit ones' zero points, or one for all, and offsets; W8A8 ones'
    column offsets; FP8 ones' scale group size); the bias."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    zeros: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    zero: int = 0
    group_size: int = 0  # FP8 scales' inputs per group (0: not FP8)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """In the order decoder_layer.cpp takes a projection's tensors."""
        return self.weight, self.scales, self.zeros, self.offsets, self.bias


@dataclass(frozen=True)
class LinearBackend:
    """How layers left in float run here: the device, the compute dtype, the float method of the
    layers and of the lm_head (model_loader/linear_setup.py's `linear_backend` picks them), and
    whether tokenmill's CPU kernels compute here (quantized layers' packed forms). `fixed_rows`: every
    layer's method, float or quantized, runs on fixed-size chunks of rows (batch invariance on library
    GEMMs: layers/fixed_shapes.py)."""

    device: torch.device
    dtype: torch.dtype
    float_linear: LinearMethod
    head_linear: LinearMethod
    kernels: bool
    fixed_rows: bool = False

    def float_method(self) -> LinearMethod:
        return self.float_linear

    def head_method(self) -> LinearMethod:
        return self.head_linear


def linear_layers(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            yield name, module


# {a local linear layer's name: the checkpoint module names its parts come from}
PartNames = dict[str, tuple[str, ...]]


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
