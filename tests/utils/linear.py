"""Linear layers of chosen methods outside a loaded model (kernel and layer tests)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.layers.linear import Linear, linear_with, replace_linear_modules
from tokenmill.models.layers.quantization import OnlineQuantization
from tokenmill.models.model_loader.linear_setup import (
    assign_linear_methods,
    linear_backend,
    process_weights_after_loading,
)


def int8_linear(linear: nn.Linear, kernels: bool) -> Linear:
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

    return linear_with(linear, Int8LinearMethod(kernels))


def prepare(model: nn.Module, packed: bool = True, quantization: str | None = None, kernels: bool = True) -> None:
    """A model's nn.Linear modules as Linear layers with the methods the engine would give them."""
    replace_linear_modules(model)
    dtype = next(model.parameters()).dtype
    quant = OnlineQuantization(quantization, kernels) if quantization else None
    assign_linear_methods(model, linear_backend(torch.device("cpu"), dtype, packed), quant, {})
    process_weights_after_loading(model)
