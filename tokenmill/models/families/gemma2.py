"""Gemma 2: Gemma with norms after attention and around the MLP, attention and final logit
softcapping, `query_pre_attn_scalar` attention scale and alternating sliding/global layers."""

from __future__ import annotations

from tokenmill.models.families.gemma import GEMMA_REQUIRED_KEYS, GemmaForCausalLM, GemmaLayer, gemma_spec
from tokenmill.models.layers.parallel import NO_TP, TPInfo
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec

GEMMA2_REQUIRED_KEYS = GEMMA_REQUIRED_KEYS + ("hidden_activation", "query_pre_attn_scalar", "sliding_window")


class Gemma2Layer(GemmaLayer):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo = NO_TP) -> None:
        super().__init__(spec, layer_idx, tp)
        self.pre_feedforward_layernorm = self.norm_class(spec.hidden_size, spec.norm_eps)
        self.post_feedforward_layernorm = self.norm_class(spec.hidden_size, spec.norm_eps)

    def forward(self, x, cos, sin, kv, meta):
        # post_attention_layernorm normalises the attention output here, not the MLP input.
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(GemmaForCausalLM):
    layer_class = Gemma2Layer


def gemma2_spec(config) -> ModelSpec:
    """Gemma 2 and 3 share these: query_pre_attn_scalar, softcaps, windows from layer_types."""
    spec = gemma_spec(config, activation=config.hidden_activation)
    spec.attn_scale = config.query_pre_attn_scalar**-0.5
    spec.attn_softcap = getattr(config, "attn_logit_softcapping", None)
    spec.final_softcap = getattr(config, "final_logit_softcapping", None)
    return spec


register(
    Architecture(
        "gemma2",
        ("Gemma2ForCausalLM",),
        Gemma2ForCausalLM,
        gemma2_spec,
        GEMMA2_REQUIRED_KEYS + ("attn_logit_softcapping", "final_logit_softcapping"),
        features="Gemma + pre/post norms, attention and final logit softcapping, alternating sliding-window layers",
    )
)
