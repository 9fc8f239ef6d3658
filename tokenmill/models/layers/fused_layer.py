"""Llama-shaped decoder layers as one C++ call on CPU fp32 and bf16 steps (`--fused-layers`).

A batch-1 decode step of a small model is a few milliseconds of memory-bound GEMMs and, around them,
~25 Python-level op dispatches, module calls and views per layer, a large share of the step (host
time in `tokenmill bench profile`, with and without `--no-fused-layers`). `tokenmill::llama_decoder_layer`
(kernels/csrc/cpu/decoder_layer.cpp) runs the same kernels in the same order from C++, so its output is
bit-identical to the Python layer's; the layer takes it whenever the step's attention all runs on
the paged kernel (decodes and chunks with cached context; first prefill chunks go through SDPA in
Python), over fp32, bf16 or int8 caches (the layer writes K/V rows into their slots itself,
quantizing int8 rows as kv_quant.to_cache does). Fused: layers of exactly the Llama structure (RMSNorm, fused qkv
with optional bias, no q/k norm, SiLU-gated MLP, no tensor parallelism) in fp32 whose four
projections are on the panel GEMM: fp32 or bf16 panels (`--packed-linear`; bf16 holds the bf16-valued
weights of a model published in bf16: the kernel widens them back to fp32), int8 (`--quantization int8`,
8-bit weight-only checkpoints), 4-bit (`--quantization int4`, 4-bit checkpoints), W8A8 (activations
rounded to int8 per token, as the Python layer's w8a8 kernel rounds them) or FP8 checkpoints; or in bf16
with the four on oneDNN (`--dtype bfloat16` on a CPU with AMX or AVX512-BF16: the same bf16 kernels as
the Python layer, whose elementwise ops then also run fused) or any of those integer or FP8 panels.
Whether a projection fuses is its linear method's answer (linear.py: `fused_projection`).
Anything wrapped later (LoRA) makes the layer stand aside. When every layer of the model is fused,
the model's forward runs them as one C++ loop (FusedStack): one check per step instead of one per
layer, and no Python between layers (Python's loop, module calls, the op's 32 boxed arguments). A
step of up to 6 tokens (batch-1 and small-batch decode; up to 64 for a bf16 model whose projections
are all on AMX tiles), fp32 or bf16, runs every layer in one parallel region, the threads sharing
each GEMM's panels or AMX blocks, the RoPE and cache writes and the attention's items and meeting at
a barrier after each (no fork/join, allocation or op checks per kernel, which shortens a small
step's layers: `tokenmill bench profile`); the same arithmetic, so the same bits
(kernels/csrc/cpu/decoder_layer.cpp).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from operator import getitem

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.models.families.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaLayer, LlamaMLP, RMSNorm
from tokenmill.models.layers.attention import AttentionMetadata
from tokenmill.models.layers.linear import Linear

logger = logging.getLogger(__name__)


class HeldModules:
    """The modules fused weights came from, each as (its owner's _modules dict, name, module)."""

    def __init__(self, entries: tuple) -> None:
        self.entries = entries
        self._dicts, self._names, expected = zip(*entries)
        self._expected = list(expected)

    def intact(self) -> bool:
        """Whether every module is still where it was (LoRA wraps projections after loading). The
        lookups and comparisons run in C (map over the dicts; a list compares its items by identity
        first, and modules have no __eq__): a few times cheaper than a Python loop over nn.Module
        attribute lookups."""
        return list(map(getitem, self._dicts, self._names)) == self._expected


@dataclass(frozen=True, eq=False)
class FusedLayer:
    held: HeldModules  # the attention, the MLP and the four projections fused
    weights: tuple  # the op's arguments from the input norm to the intermediate size
    attention: tuple  # scale, window, softcap

    def applies(self, meta: AttentionMetadata) -> bool:
        return meta.paged_only and self.held.intact()

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        p = meta.paged
        assert p is not None  # (called where it applies: every query on the paged kernel)
        return ops.llama_decoder_layer(
            x,
            *self.weights,
            cos,
            sin,
            kv[0],
            kv[1],
            meta.slot_mapping,
            p.query_start,
            p.query_lens,
            p.block_tables,
            p.context_lens,
            meta.block_size,
            *self.attention,
        )


def _held_modules(layer: LlamaLayer) -> HeldModules:
    """FusedLayer.held of a layer as it is now."""
    owners = (
        (layer, ("self_attn", "mlp")),
        (layer.self_attn, ("qkv_proj", "o_proj")),
        (layer.mlp, ("gate_up_proj", "down_proj")),
    )
    return HeldModules(tuple((owner._modules, name, owner._modules[name]) for owner, names in owners for name in names))


class FusedStack:
    """Every decoder layer of a model fused: a step's layers run as one C++ loop
    (`torch.classes.tokenmill.DecoderStack`, holding each layer's weights), with one check per step
    instead of one per layer and no Python between layers (LlamaForCausalLM.forward takes it). The
    RoPE rows of the step's positions are gathered and the model's final norm applied in the same
    call (cold Python ops are slow after a step's weights went through the caches)."""

    def __init__(self, layers: tuple[FusedLayer, ...], final_norm: RMSNorm) -> None:
        self.layers = layers
        # Every layer's held modules in one check per step, not a call per layer.
        self._held = HeldModules(tuple(entry for layer in layers for entry in layer.held.entries))
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        floats: list[float] = []
        for layer in layers:
            norm, post_norm, eps, projections, zero_points, group_sizes, heads, kv_heads, intermediate = layer.weights
            scale, window, softcap = layer.attention
            tensors += [norm, post_norm, *projections]
            ints += [heads, kv_heads, intermediate, window, *zero_points, *group_sizes]
            floats += [eps, scale, softcap]
        self.native = ops.decoder_stack(tensors, ints, floats, final_norm.weight.detach(), final_norm.eps)

    def applies(self, meta: AttentionMetadata) -> bool:
        return meta.paged_only and self._held.intact()

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        kv_caches: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final norm of the last layer's output (x: the embedded tokens; rope_tables: the model's
        cos/sin [positions, rotary])."""
        p = meta.paged
        assert p is not None  # (called where it applies: every query on the paged kernel)
        return self.native.forward(
            x,
            positions,
            *rope_tables,
            [kv[0] for kv in kv_caches],
            [kv[1] for kv in kv_caches],
            meta.slot_mapping,
            p.query_start,
            p.query_lens,
            p.block_tables,
            p.context_lens,
            meta.block_size,
        )


def _fused_layer(layer: LlamaLayer) -> FusedLayer | None:
    """The layer as one C++ call, if it has exactly the Llama structure and every projection's method
    computes it for the layer's activations (the norm weight's dtype)."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
    if not (
        type(layer).forward is LlamaLayer.forward
        and type(norm) is RMSNorm
        and type(layer.post_attention_layernorm) is RMSNorm
        and isinstance(attn, LlamaAttention)
        and type(attn).forward is LlamaAttention.forward
        and type(attn).project_qkv is LlamaAttention.project_qkv
        and attn.qk_norm_class is None
        and not attn.tp.enabled
        and isinstance(mlp, LlamaMLP)
        and type(mlp).forward is LlamaMLP.forward
        and mlp.silu
        and not mlp.tp.enabled
    ):
        return None
    activations = norm.weight.dtype
    projections = []
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        fused = linear.quant_method.fused_projection(linear, activations) if isinstance(linear, Linear) else None
        if fused is None:
            return None
        projections.append(fused)
    return FusedLayer(
        _held_modules(layer),
        (
            norm.weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            norm.eps,
            [t for p in projections for t in p.tensors()],
            [p.zero for p in projections],
            [p.group_size for p in projections],
            attn.num_heads,
            attn.num_kv_heads,
            mlp.intermediate,
        ),
        (attn.scale, attn.window or 0, attn.softcap or 0.0),
    )


def fuse_decoder_layers(model: nn.Module) -> int:
    """Give every fusable decoder layer of `model` its one-call path (see the module docstring);
    returns how many."""
    count = 0
    for layer in model.modules():
        if not isinstance(layer, LlamaLayer):
            continue
        fused = _fused_layer(layer)
        if fused is None:
            continue
        layer.fused = fused
        count += 1
    if count and isinstance(model, LlamaForCausalLM):
        layers = [layer for layer in model.layers if isinstance(layer, LlamaLayer)]
        stacked = [layer.fused for layer in layers if layer.fused is not None]
        final_norm = model.norm
        if (
            len(stacked) == len(model.layers)
            and not any(model.layer_rope)  # (one RoPE table for all: the stack takes one)
            and type(final_norm) is RMSNorm
            and final_norm.weight.dtype == layers[0].input_layernorm.weight.dtype
        ):
            model.fused_stack = FusedStack(tuple(stacked), final_norm)
    if count:
        logger.info("decoder layers fused into one call per step: %d", count)
    return count
