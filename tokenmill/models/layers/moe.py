"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): top-k routing exactly as
transformers computes it, and batched expert dispatch.

Dispatch: the step's (token, expert) pairs are sorted by expert (stable, so each expert's rows stay
in token order) and each expert's rows run as one GEMM, never a loop per token; the outputs are put
back in (token, k) order, scaled by the routing weights and summed over k (the order of HF's
`grouped_mm` experts path, and deterministic: no scatter-add).

Expert weights load stacked: `gate_up_proj` [E, 2 * I, H] and `down_proj` [E, H, I], HF's own fused
layout, and run in one of two ways:
- `GroupedExperts` (default): the stacked weights through `torch.nn.functional.grouped_mm`, one
  call per projection over all experts, no host sync (suits GPUs and `--compile`).
- `ExpertLinears`: one linear layer per expert, looped over the experts that received tokens; the
  form quantized experts take (`split_experts` makes it at load: views of the stacked weights, each
  given the quantization's method).
`tokenmill bench moe-dispatch` times them on Mixtral-like and Qwen3-MoE-like experts. fp32 experts
stay on grouped_mm, also under `--packed-linear` (packing wins only for few, wide experts at large
batches; it loses at batch 1 and with many narrow experts), and int8 experts run as the loop (4x
fewer bytes than fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from tokenmill.models.layers.linear import Linear, LinearMethod


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool  # renormalise the top-k probabilities to sum to 1
    # Qwen-MoE casts the routing weights to the model dtype before scaling expert outputs; Mixtral
    # scales in fp32 (only visible in half precision).
    weights_in_model_dtype: bool
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert with a sigmoid gate
    activation: str = "silu"


def moe_config(config) -> MoEConfig:
    """The MoE facts of a transformers Mixtral / Qwen2-MoE / Qwen3-MoE config."""
    if config.model_type == "mixtral":
        # MixtralTopKRouter always renormalises the top-k and scales in fp32.
        return MoEConfig(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            expert_intermediate_size=config.intermediate_size,
            normalize_top_k=True,
            weights_in_model_dtype=False,
            activation=config.hidden_act,
        )
    if config.model_type in ("qwen2_moe", "qwen3_moe"):
        return MoEConfig(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            expert_intermediate_size=config.moe_intermediate_size,
            normalize_top_k=bool(config.norm_topk_prob),
            weights_in_model_dtype=True,
            shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
            activation=config.hidden_act,
        )
    raise ValueError(f"no mixture-of-experts layout known for model_type {config.model_type!r}")


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` has experts (Qwen-MoE: `decoder_sparse_step`, `mlp_only_layers`)."""
    if config.model_type == "mixtral":
        return True
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class TopKRouter(nn.Module):
    """Router logits in the model dtype, softmax in fp32, top-k (HF's *TopKRouter). A plain
    parameter, not a linear layer: packing and quantization must not touch routing."""

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] and expert ids [T, k] of hidden states [T, H]."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, expert_ids = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.config.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, expert_ids


def grouped_mm_supported(weight: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    if weight.device.type == "cuda":  # (the CUDA kernel: bf16 on sm80+)
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    return weight.device.type == "cpu"


class GroupedExperts(nn.Module):
    """All experts' weights stacked; forward takes rows grouped by expert and each group's size.
    The experts compute in their weights' dtype: under bf16 weights with fp32 arithmetic (`--dtype
    bfloat16` on a CPU without native bf16) the stacks stay bf16 (the bulk of an MoE's bytes) and
    the rows go through them in bf16, as grouped_mm takes one dtype."""

    computes_in_weight_dtype = True  # (engine.setup.round_weights narrows these weights' storage)
    # Set at load when the experts are quantized: they then run as ExpertLinears of this method.
    linear_method: LinearMethod | None = None

    def __init__(self, hidden_size: int, config: MoEConfig) -> None:
        super().__init__()
        e, i = config.num_experts, config.expert_intermediate_size
        self.intermediate = i
        self.act = ACT2FN[config.activation]
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self._forward(rows.to(self.gate_up_proj.dtype), counts).to(rows.dtype)

    def _forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if not grouped_mm_supported(self.gate_up_proj):
            return _loop_over_experts(rows, counts, self._expert)
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets).split(self.intermediate, -1)
        return F.grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).split(self.intermediate, -1)
        return F.linear(self.act(gate) * up, self.down_proj[e])


class ExpertLinears(nn.Module):
    """One gate_up and one down linear layer per expert, of `method` (views of the stacked weights)."""

    def __init__(self, experts: GroupedExperts, method: LinearMethod) -> None:
        super().__init__()
        self.intermediate = experts.intermediate
        self.act = experts.act
        self.gate_up = nn.ModuleList(_linear_view(w, method) for w in experts.gate_up_proj.detach())
        self.down = nn.ModuleList(_linear_view(w, method) for w in experts.down_proj.detach())

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return _loop_over_experts(rows, counts, self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[e](x).split(self.intermediate, -1)
        return self.down[e](self.act(gate) * up)


def _linear_view(weight: torch.Tensor, method: LinearMethod) -> Linear:
    """A linear layer of `method` over one expert's slice of the stacked float weight (shares its
    memory until the method processes it)."""
    with torch.device("meta"):
        linear = Linear(weight.shape[1], weight.shape[0])
    linear.quant_method = method  # (a method of float weights: its weight is this view)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _loop_over_experts(rows: torch.Tensor, counts: torch.Tensor, expert) -> torch.Tensor:
    """One GEMM per expert that received rows (a loop over experts, not tokens)."""
    out = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = expert(e, rows[start : start + n])
            start += n
    return out


@torch.compiler.disable  # data-dependent grouping: torch.compile graphs stop here
def dispatch(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: nn.Module, num_experts: int
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for hidden states x [T, H]."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.flatten()
    order = flat_ids.argsort(stable=True)  # pairs grouped by expert, token order within each
    # (not bincount: its output size depends on the data, a host sync on GPUs)
    counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(
        0, flat_ids, torch.ones_like(flat_ids)
    )
    out_sorted = experts(x.index_select(0, order // top_k), counts)
    out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)  # back to (token, k) order
    weighted = out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


class SparseMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert) in place of a layer's dense MLP."""

    def __init__(self, hidden_size: int, config: MoEConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = TopKRouter(hidden_size, config)
        self.experts: nn.Module = GroupedExperts(hidden_size, config)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        out = dispatch(x, weights, expert_ids, self.experts, self.num_experts)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # (built with the shared expert)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def split_experts(model: nn.Module) -> int:
    """Replace every GroupedExperts given a linear method at load by ExpertLinears of that method
    (once the stacked weights are loaded, before the linear layers process them); returns how many
    layers changed."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, SparseMoE) and isinstance(module.experts, GroupedExperts):
            method = module.experts.linear_method
            if method is not None:
                module.experts = ExpertLinears(module.experts, method)
                count += 1
    return count


def dispatch_is_host_sync_free(model: nn.Module) -> bool:
    """Whether every MoE layer runs its experts without reading the expert counts on the host
    (grouped_mm); the per-expert loop reads them, which CUDA graph capture forbids."""
    return all(
        isinstance(m.experts, GroupedExperts) and grouped_mm_supported(m.experts.gate_up_proj)
        for m in model.modules()
        if isinstance(m, SparseMoE)
    )
