"""Linear layers of chosen methods outside a loaded model (kernel and layer tests)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.layers.linear import (
    Linear,
    LinearBackend,
    assign_linear_methods,
    linear_with,
    process_weights_after_loading,
    replace_linear_modules,
)
from tokenmill.models.layers.quantization import OnlineQuantization


def int8_linear(linear: nn.Linear, kernels: bool) -> Linear:
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

    return linear_with(linear, Int8LinearMethod(kernels))


def prepare(model: nn.Module, packed: bool = True, quantization: str | None = None, kernels: bool = True) -> None:
    """A model's nn.Linear modules as Linear layers with the methods the engine would give them."""
    replace_linear_modules(model)
    dtype = next(model.parameters()).dtype
    quant = OnlineQuantization(quantization, kernels) if quantization else None
    assign_linear_methods(model, LinearBackend(torch.device("cpu"), dtype, packed), quant, {})
    process_weights_after_loading(model)
