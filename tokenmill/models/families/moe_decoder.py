"""Llama-shaped decoders whose feed-forward is a mixture of experts: Mixtral, Qwen2-MoE, Qwen3-MoE.

Attention, norms, RoPE and dense MLPs are the Llama family's (llama.py; Qwen3-MoE's attention is
Qwen3's, with q/k norms); the MLP of each sparse layer is a `moe.SparseMoE` (top-k routing,
batched expert dispatch). Qwen3-MoE configs name the expert count `num_experts` or (as
transformers 5 saves them) `num_local_experts`, so it is not a required key: a checkpoint with
another count fails the loader's shape or name checks. Checkpoints load in either
layout: the per-expert tensors that transformers' `save_pretrained` writes (`experts.N.w1/w2/w3` in
Mixtral, `experts.N.gate_proj/up_proj/down_proj` in Qwen-MoE), stacked into [E, ...] at load, or
the fused `experts.gate_up_proj` / `experts.down_proj` tensors of transformers' modules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from tokenmill.models.families.llama import LLAMA_REQUIRED_KEYS, LlamaForCausalLM, LlamaLayer, LlamaMLP, llama_spec
from tokenmill.models.families.qwen3 import Qwen3Attention
from tokenmill.models.layers.moe import MoEConfig, SparseMoE, dispatch_is_host_sync_free, is_sparse_layer, moe_config
from tokenmill.models.layers.parallel import NO_TP, TPInfo
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec


@dataclass(kw_only=True)
class MoESpec(ModelSpec):
    moe: MoEConfig
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP


def moe_spec(config, *, qkv_bias: bool, o_bias: bool, uniform_window: bool) -> MoESpec:
    base = llama_spec(config, qkv_bias=qkv_bias, o_bias=o_bias, uniform_window=uniform_window)
    sparse = tuple(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
    return MoESpec(
        **{f.name: getattr(base, f.name) for f in fields(base)}, moe=moe_config(config), sparse_layers=sparse
    )


# Per-expert checkpoint tensors: layers.L.mlp.experts.E.{w1|w3|w2|gate_proj|up_proj|down_proj}.weight
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


class MoELayer(LlamaLayer):
    """A Llama layer whose MLP, on the config's sparse layers, is a mixture of experts."""

    def __init__(self, spec: MoESpec, layer_idx: int, tp: TPInfo = NO_TP) -> None:
        super().__init__(spec, layer_idx, tp)  # (its dense MLP is built on the meta device: free)
        if spec.sparse_layers[layer_idx]:
            self.mlp = SparseMoE(spec.hidden_size, spec.moe, _shared_expert(spec, spec.moe))


class Qwen3MoELayer(MoELayer):
    attention_class = Qwen3Attention  # q/k RMSNorm per head


class MoEForCausalLM(LlamaForCausalLM):
    # Experts are not sharded: --tensor-parallel-size > 1 is refused for these models.
    supports_tensor_parallel = False
    layer_class = MoELayer

    def __init__(self, spec: MoESpec, tp: TPInfo = NO_TP) -> None:
        super().__init__(spec, tp)
        # Loader groups: each expert's checkpoint tensors stack into one [E, ...] weight.
        self.fused_parts = {"experts.gate_up": 2 * spec.moe.num_experts, "experts.down": spec.moe.num_experts}

    @property
    def supports_cuda_graphs(self) -> bool:
        """False once experts run as a per-expert loop (int8, or a dtype/GPU without grouped_mm)."""
        return dispatch_is_host_sync_free(self)

    @staticmethod
    def hf_to_local(name: str) -> tuple[str, int | None, str | None]:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # (Mixtral's old name)
        per_expert = _PER_EXPERT.match(name)
        if per_expert:
            prefix, expert, proj = per_expert.group(1), int(per_expert.group(2)), per_expert.group(3)
            if proj in ("w2", "down_proj"):
                return f"{prefix}.down_proj", expert, "experts.down"
            return f"{prefix}.gate_up_proj", 2 * expert + _GATE_UP_PART[proj], "experts.gate_up"
        if ".mlp.shared_expert." in name:
            for i, proj in enumerate(("gate_proj", "up_proj")):
                if f".{proj}." in name:
                    return name.replace(proj, "gate_up_proj"), i, "gate_up"
        return LlamaForCausalLM.hf_to_local(name)


class Qwen3MoEForCausalLM(MoEForCausalLM):
    layer_class = Qwen3MoELayer


def _shared_expert(spec: MoESpec, moe: MoEConfig) -> LlamaMLP | None:
    """Qwen2-MoE's always-on expert: a gated MLP like Llama's, of its own width."""
    if not moe.shared_expert_intermediate_size:
        return None
    return LlamaMLP(replace(spec, intermediate_size=moe.shared_expert_intermediate_size))


register(
    Architecture(
        "mixtral",
        ("MixtralForCausalLM",),
        MoEForCausalLM,
        lambda c: moe_spec(c, qkv_bias=False, o_bias=False, uniform_window=True),
        LLAMA_REQUIRED_KEYS + ("num_local_experts", "num_experts_per_tok"),
        features="Mistral + sparse MoE (top-k routing, batched expert GEMMs), sliding window on every layer",
    )
)
register(
    Architecture(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        MoEForCausalLM,
        lambda c: moe_spec(c, qkv_bias=bool(c.qkv_bias), o_bias=False, uniform_window=False),
        LLAMA_REQUIRED_KEYS
        + ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"),
        features="Qwen2 + sparse MoE with a sigmoid-gated shared expert, decoder_sparse_step/mlp_only_layers, "
        "sliding window via layer_types",
    )
)
register(
    Architecture(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        Qwen3MoEForCausalLM,
        # HF Qwen3MoeAttention: `attention_bias` on all four projections, the window on every layer.
        lambda c: moe_spec(c, qkv_bias=bool(c.attention_bias), o_bias=bool(c.attention_bias), uniform_window=True),
        LLAMA_REQUIRED_KEYS + ("num_experts_per_tok", "moe_intermediate_size"),
        features="Qwen3 (q/k norm) + sparse MoE, norm_topk_prob, decoder_sparse_step/mlp_only_layers",
    )
)
