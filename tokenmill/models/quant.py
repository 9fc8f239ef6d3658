"""Weight-only int8 quantization of the linear layers (per output channel).

On CPU the linear layers become torch.ao dynamic-quantized modules: int8 weights with a scale per
output channel, activations quantized per step, int8 GEMMs from fbgemm (4x fewer weight bytes to
stream, the bound of decode). On GPU each weight is stored in int8 and dequantised on the fly.
MoE expert weights are split into one linear per expert first and quantized the same way; MoE
routers are not linear layers and stay in the model dtype (int8 routing would pick other experts).
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from tokenmill.models.moe import split_experts

logger = logging.getLogger(__name__)


class WeightOnlyInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight_int8.to(x.dtype)) * self.scale
        return out + self.bias if self.bias is not None else out


def _untie_lm_head(model: nn.Module) -> None:
    # The tied lm_head shares the embedding Parameter; quantize a copy so the embedding stays exact.
    head = getattr(model, "lm_head", None)
    if head is None:
        return
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)


def quantize_model(model: nn.Module, method: str) -> None:
    if method != "int8":
        raise ValueError(f"unsupported quantization {method!r}; supported: int8")
    _untie_lm_head(model)
    split_experts(model)
    device = next(model.parameters()).device
    before = _linear_bytes(model)
    if device.type == "cpu":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notice points at torchao
            quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    else:
        _replace_linears(model)
    logger.info("int8 weights: linear layers %.1f MiB -> ~%.1f MiB", before / 2**20, before / 4 / 2**20)


def _replace_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, WeightOnlyInt8Linear(child))
        else:
            _replace_linears(child)


def _linear_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
