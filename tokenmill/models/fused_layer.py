"""Llama-shaped decoder layers as one C++ call on CPU fp32 steps (`--fused-layers`).

A batch-1 decode step of a small model is a few milliseconds of memory-bound GEMMs and, around them,
~25 Python-level op dispatches, module calls and views per layer: on SmolLM2 (30 layers) taking it
out brought a batch-1 step from ~23 to ~18.5 ms (bench/README.md). `tokenmill::llama_decoder_layer`
(kernels/csrc/decoder_layer.cpp) runs the same kernels in the same order from C++, so its output is
bit-identical to the Python layer's; the layer takes it whenever the step's attention all runs on
the paged kernel (decodes and chunks with cached context; first prefill chunks go through SDPA in
Python) and the cache is not int8. Fused: layers of exactly the Llama structure (RMSNorm, fused qkv
with optional bias, no q/k norm, SiLU-gated MLP, no tensor parallelism) in fp32 whose four
projections are on the panel GEMM: fp32 or bf16 panels (`--packed-linear`; bf16 holds the bf16-valued
weights of a model published in bf16: the kernel widens them back to fp32) or int8 (`--quantization int8`).
Anything wrapped later (LoRA) makes the layer stand aside.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models.attention import AttentionMetadata
from tokenmill.models.llama import LlamaAttention, LlamaLayer, LlamaMLP, RMSNorm
from tokenmill.models.packed_linear import PanelLinear
from tokenmill.models.quant import WeightOnlyInt8Linear

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class FusedLayer:
    projections: tuple[nn.Module, ...]  # qkv, o, gate_up, down: the modules the weights came from
    weights: tuple  # the op's arguments from the input norm to the intermediate size
    attention: tuple  # scale, window, softcap

    def applies(self, layer: LlamaLayer, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> bool:
        attn, mlp = layer.self_attn, layer.mlp
        return (meta.paged_only and kv[0].dtype != torch.int8
                and self.projections == (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
        p = meta.paged
        return torch.ops.tokenmill.llama_decoder_layer(
            x, *self.weights, cos, sin, kv[0], kv[1], meta.slot_mapping, p.query_start, p.query_lens,
            p.block_tables, p.context_lens, meta.block_size, *self.attention)


def _fusable(layer: LlamaLayer) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    return (type(layer).forward is LlamaLayer.forward
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and isinstance(attn, LlamaAttention) and type(attn).forward is LlamaAttention.forward
            and type(attn).project_qkv is LlamaAttention.project_qkv and attn.qk_norm_class is None
            and not attn.tp.enabled
            and isinstance(mlp, LlamaMLP) and type(mlp).forward is LlamaMLP.forward and mlp.silu and not mlp.tp.enabled
            and layer.input_layernorm.weight.dtype == torch.float32
            and all(_on_panels(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))


def _on_panels(linear: nn.Module) -> bool:
    """fp32, bf16 or int8 panels (the activations are fp32: _fusable asks for an fp32 norm)."""
    if type(linear) is PanelLinear:
        return True
    return type(linear) is WeightOnlyInt8Linear and linear.use_cpu_kernel


def _panel_arguments(linear: nn.Module) -> tuple:
    """(weight, scales or None, bias or None) of a projection on the panel GEMM."""
    if type(linear) is PanelLinear:
        return linear.packed_weight, None, linear.bias
    bias = None if linear.bias is None else linear.bias.detach()
    return linear.qweight, linear.scales, bias


def fuse_decoder_layers(model: nn.Module) -> int:
    """Give every fusable decoder layer of `model` its one-call path (see the module docstring);
    returns how many."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, LlamaLayer) or not _fusable(layer):
            continue
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        layer.fused = FusedLayer(
            linears,
            (norm.weight.detach(), layer.post_attention_layernorm.weight.detach(), norm.eps,
             *(t for m in linears for t in _panel_arguments(m)), attn.num_heads, attn.num_kv_heads,
             mlp.intermediate),
            (attn.scale, attn.window or 0, attn.softcap or 0.0))
        count += 1
    if count:
        logger.info("decoder layers fused into one call per step: %d", count)
    return count
