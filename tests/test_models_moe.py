"""Mixture-of-experts: routing and batched expert dispatch against transformers' sparse MoE blocks."""

from __future__ import annotations

import pytest
import torch

from tokenmill.models.moe import ExpertLinears, SparseMoE, moe_config, split_experts

HIDDEN = 64


def _hf_block(model_type: str, experts_implementation: str = "eager"):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if model_type == "mixtral":
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(config)
    else:
        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=model_type.endswith("norm"))
        block = Qwen3MoeSparseMoeBlock(config)
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            # A sharp router (clear top-k choices), experts at unit gain so outputs are O(1).
            p.normal_(0, HIDDEN**-0.5 * (3 if name.startswith("gate") else 1))
    return config, block.eval()


def _ours(config, block) -> SparseMoE:
    layer = SparseMoE(HIDDEN, moe_config(config))
    layer.load_state_dict(block.state_dict())  # HF's fused names: gate.weight, experts.gate_up_proj/down_proj
    return layer.eval()


def _hidden(tokens: int, dead_experts: tuple[int, ...], block) -> torch.Tensor:
    """Random hidden states; experts in `dead_experts` are made unreachable through the router."""
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    if dead_experts:
        x[:, 0] = 3 + x[:, 0].abs()
        with torch.no_grad():
            block.gate.weight[list(dead_experts), 0] = -50.0
    return x


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen3_moe_norm"])
@pytest.mark.parametrize("tokens,dead", [(1, ()), (7, (1, 5)), (64, (0, 3, 7))])
@pytest.mark.parametrize("hf_experts", ["eager", "grouped_mm"])
def test_dispatch_matches_hf_sparse_moe_block(model_type, tokens, dead, hf_experts):
    config, block = _hf_block(model_type, hf_experts)
    x = _hidden(tokens, dead, block)
    ours = _ours(config, block)
    with torch.inference_mode():
        expected = block(x[None])[0]
        _, expert_ids = ours.gate(x)
        assert not torch.isin(expert_ids, torch.tensor(dead)).any()
        if tokens > 1:
            assert expert_ids.unique().numel() > 2  # several experts really share the batch
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)
        split_experts(ours)  # the per-expert loop (the form oneDNN and int8 rewrite)
        assert isinstance(ours.experts, ExpertLinears)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


def test_onednn_packing_and_int8_handle_expert_weights():
    from tokenmill.models.onednn import PackedLinear, onednn_linear_available, pack_linears
    from tokenmill.models.quant import quantize_model

    config, block = _hf_block("mixtral")
    x = _hidden(32, (2,), block)
    with torch.inference_mode():
        expected = block(x[None])[0]
    if onednn_linear_available():
        packed = _ours(config, block)
        assert pack_linears(packed) == 2 * 8  # gate_up and down of every expert
        assert isinstance(packed.experts.gate_up[0], PackedLinear)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=0)
    int8 = _ours(config, block)
    router_before = int8.gate.weight.detach().clone()
    quantize_model(int8, "int8")
    assert type(int8.experts.gate_up[0]).__module__.startswith("torch.ao")  # experts quantized ...
    assert torch.equal(int8.gate.weight, router_before)  # ... routing untouched
    with torch.inference_mode():
        got = int8(x)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.99, cosine
