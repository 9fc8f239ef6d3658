"""Mixture-of-experts: routing and batched expert dispatch against transformers' sparse MoE blocks."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu_caps import detect
from tokenmill.models.layers.linear import UNQUANTIZED
from tokenmill.models.layers.moe import ExpertLinears, SparseMoE, moe_config, split_experts

HIDDEN = 64


def _hf_block(model_type: str, experts_implementation: str = "eager"):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if model_type == "mixtral":
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)
        block = MixtralSparseMoeBlock(config)
    else:
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=model_type.endswith("norm"),
        )
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


@pytest.mark.unit
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
        ours.experts.linear_method = UNQUANTIZED
        split_experts(ours)  # the per-expert loop (the form quantized experts take)
        assert isinstance(ours.experts, ExpertLinears)
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


@pytest.mark.unit
def test_packing_leaves_experts_and_int8_quantizes_them():
    from tests.utils.linear import prepare
    from tokenmill.models.layers.moe import GroupedExperts

    config, block = _hf_block("mixtral")
    x = _hidden(32, (2,), block)
    with torch.inference_mode():
        expected = block(x[None])[0]
    packed = _ours(config, block)
    prepare(packed)  # router and stacked experts are not linear layers: left alone
    assert isinstance(packed.experts, GroupedExperts)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=0)
    int8 = _ours(config, block)
    router_before = int8.gate.weight.detach().clone()
    prepare(int8, quantization="int8")
    assert int8.experts.gate_up[0].quant_method.name == "int8"  # experts quantized ...
    assert torch.equal(int8.gate.weight, router_before)  # ... routing untouched
    with torch.inference_mode():
        got = int8(x)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.99, cosine


# --- whole models through the engine -------------------------------------------------------------


def _tiny_configs() -> dict:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        # A 48-token sliding window: prompts and outputs run past it.
        "mixtral": MixtralConfig(
            **common,
            intermediate_size=96,
            num_hidden_layers=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=48,
        ),
        # Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers); top-k not renormalised.
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            num_hidden_layers=3,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
        # Layer 0 dense, layer 1 sparse (decoder_sparse_step 2); q/k norms; top-k renormalised.
        "qwen3_moe": Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            num_hidden_layers=2,
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            head_dim=16,
            norm_topk_prob=True,
        ),
    }


MOE_TYPES = list(_tiny_configs())


@pytest.fixture(scope="module")
def moe_model_dirs(tmp_path_factory, default_model_dir) -> dict:
    from tests.conftest import save_random_model

    return {
        name: save_random_model(config, default_model_dir, tmp_path_factory.mktemp(f"tiny-{name}"), seed=3)
        for name, config in _tiny_configs().items()
    }


def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_greedy_matches_hf_generate(moe_model_dirs, model_type):
    """Batched mixed-length prompts, chunked prefill (64-token budget) and a prefix-cache hit."""
    from tests.conftest import hf_greedy, mixed_prompts
    from tokenmill import LLM, SamplingParams

    model_dir = moe_model_dirs[model_type]
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = mixed_prompts(6, 1, 150, seed=13)
    assert max(map(len, prompts)) > 64  # some prompts prefill in several chunks
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # Second round: the longest prompt's first 96 tokens (6 cached blocks) with new endings.
    prefix = max(prompts, key=len)[:96]
    followups = [prefix + suffix for suffix in mixed_prompts(3, 2, 20, seed=14)]
    hits_before = llm.engine.stats().prefix_cache_hits_total
    outs += [o.outputs[0].token_ids for o in llm.generate(followups, params)]
    assert llm.engine.stats().prefix_cache_hits_total > hits_before
    for prompt, got in zip(prompts + followups, outs):
        assert got == hf_greedy(model_dir, prompt, 12), f"{len(prompt)}-token prompt"
    assert len({tuple(o) for o in outs}) > 1  # not one degenerate output for everything


def _save_fused_layout(model_dir, target):
    """The same model saved with transformers' in-memory names (experts.gate_up_proj [E, 2I, H])."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(model_dir, target)
    (target / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in _hf_model(model_dir).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("model_type", MOE_TYPES)
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_loaded_layers_match_hf_layers(moe_model_dirs, tmp_path, model_type, layout):
    """Every layer's MLP (sparse with its shared expert, or dense) as loaded from either checkpoint
    layout equals transformers' on random hidden states, each routing path included."""
    from tokenmill.models.layers.packed_linear import packed_method_for
    from tokenmill.models.model_loader.linear_setup import (
        assign_linear_methods,
        linear_backend,
        process_weights_after_loading,
    )
    from tokenmill.models.model_loader.loader import load_model

    model_dir = moe_model_dirs[model_type]
    if layout == "fused":
        model_dir = _save_fused_layout(model_dir, tmp_path / "fused")
    ours, spec = load_model(model_dir, torch.float32, torch.device("cpu"), progress=False)
    hf = _hf_model(moe_model_dirs[model_type])
    x = torch.randn(40, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = [layer.mlp(x[None])[0] for layer in hf.model.layers]
        for ours_layer, want in zip(ours.layers, expected):
            torch.testing.assert_close(ours_layer.mlp(x), want, atol=1e-5, rtol=0)
        assign_linear_methods(ours, linear_backend(torch.device("cpu"), torch.float32, True), None, {})
        for layer in ours.layers:  # the per-expert form (quantized experts'), its linears packed as well
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.linear_method = packed_method_for(torch.float32)
        process_weights_after_loading(ours)
        for ours_layer, want in zip(ours.layers, expected):
            torch.testing.assert_close(ours_layer.mlp(x), want, atol=1e-5, rtol=0)
    assert [type(layer.mlp).__name__ for layer in ours.layers] == [
        "SparseMoE" if sparse else "LlamaMLP" for sparse in spec.sparse_layers
    ]


def test_checkpoint_with_an_extra_expert_is_refused(moe_model_dirs, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill.errors import ModelLoadError
    from tokenmill.models.model_loader.loader import load_model

    target = shutil.copytree(moe_model_dirs["mixtral"], tmp_path / "extra")
    state = load_file(str(target / "model.safetensors"))
    state["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = state[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    ].clone()
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.8\.w1"):
        load_model(target, torch.float32, torch.device("cpu"), progress=False)


def test_tensor_parallel_is_refused_for_moe(moe_model_dirs):
    from tokenmill.models.layers.parallel import check_shardable
    from tokenmill.models.model_loader.loader import load_spec

    with pytest.raises(ValueError, match="mixtral"):
        check_shardable(load_spec(moe_model_dirs["mixtral"]), 2)


def test_int8_engine_quantizes_experts_and_mostly_agrees(moe_model_dirs):
    from tests.conftest import mixed_prompts
    from tokenmill import LLM, SamplingParams

    model_dir = str(moe_model_dirs["qwen2_moe"])
    prompts = mixed_prompts(12, 5, 40, seed=32)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    fp32 = [
        o.outputs[0].token_ids
        for o in LLM(model_dir, progress=False, kv_cache_memory="16MiB").generate(prompts, params)
    ]
    q = LLM(model_dir, progress=False, kv_cache_memory="16MiB", quantization="int8")
    int8 = [o.outputs[0].token_ids for o in q.generate(prompts, params)]
    # Experts and shared expert too, and the lm_head (tokenmill's CPU kernels); the routers are not
    # linear layers and stay in the model dtype.
    from tokenmill.kernels.ops import cpu_kernels_available
    from tokenmill.models.layers.linear import linear_layers

    assert not any(type(m) is torch.nn.Linear for m in q.engine.model.modules())
    if cpu_kernels_available(torch.device("cpu")):
        assert {layer.quant_method.name for _, layer in linear_layers(q.engine.model)} == {"int8"}
    # (Lower than the dense Llama's 0.75: int8 noise also flips near-tied routing choices. Wrong
    # expert weights or routing would agree ~never: 12 prompts over a 49k vocabulary.)
    first_token_agreement = sum(a[0] == b[0] for a, b in zip(fp32, int8)) / len(prompts)
    assert first_token_agreement >= 0.5, first_token_agreement


def test_roofline_counts_only_routed_experts(moe_model_dirs):
    from tokenmill.bench.roofline import model_weight_bytes
    from tokenmill.models.model_loader.loader import load_model

    model, spec = load_model(moe_model_dirs["mixtral"], torch.float32, torch.device("cpu"), progress=False)
    total, streamed = model_weight_bytes(model)
    experts = sum(p.numel() * 4 for name, p in model.named_parameters() if ".experts." in name)
    untied_embedding = spec.vocab_size * spec.hidden_size * 4
    assert streamed == total - untied_embedding - experts * (8 - 2) // 8  # top-2 of 8 read per step


def _cli(*args: str, timeout: float = 600) -> str:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_bench_offline_runs_on_a_moe_model(moe_model_dirs, tmp_path):
    import json

    report = tmp_path / "offline.json"
    _cli(
        "bench",
        "offline",
        "--model",
        str(moe_model_dirs["qwen2_moe"]),
        "--num-prompts",
        "4",
        "--min-input",
        "4",
        "--max-input",
        "24",
        "--min-output",
        "2",
        "--max-output",
        "4",
        "--no-progress",
        "--kv-cache-memory",
        "16MiB",
        "--json",
        str(report),
    )
    run = json.loads(report.read_text())["tokenmill"]
    assert run["num_requests"] == 4 and run["output_tokens"] == run["requested_tokens"] > 0


def test_bench_moe_dispatch_command(tmp_path):
    import json

    report = tmp_path / "dispatch.json"
    out = _cli(
        "bench",
        "moe-dispatch",
        "--hidden-size",
        "32",
        "--intermediate-size",
        "48",
        "--num-experts",
        "4",
        "--tokens",
        "1",
        "9",
        "--reps",
        "1",
        "--json",
        str(report),
    )
    assert "grouped_mm" in out
    rows = json.loads(report.read_text())["rows"]
    assert {r["tokens"] for r in rows} == {1, 9} and all(r["best_ms"] > 0 for r in rows)
    assert all(r["max_abs_diff"] < 1e-4 for r in rows if "int8" not in r["method"])


def test_bfloat16_engine_runs_and_mostly_agrees(moe_model_dirs):
    """bf16 weights, experts through grouped_mm in bf16 (on a CPU without native bf16 the rest of the
    model computes in fp32 over bf16-rounded weights: the expert stacks stay bf16 all the same)."""
    from tests.conftest import mixed_prompts
    from tokenmill import LLM, SamplingParams

    model_dir = str(moe_model_dirs["qwen3_moe"])
    prompts = mixed_prompts(12, 5, 40, seed=33)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    fp32 = [
        o.outputs[0].token_ids
        for o in LLM(model_dir, progress=False, kv_cache_memory="16MiB").generate(prompts, params)
    ]
    half = LLM(model_dir, progress=False, kv_cache_memory="16MiB", dtype="bfloat16")
    assert half.engine.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    if not detect().native_bf16:  # fp32 arithmetic elsewhere, over bf16 values
        norm = half.engine.model.layers[1].input_layernorm.weight
        assert norm.dtype == torch.float32 and torch.equal(norm, norm.bfloat16().float())
    bf16 = [o.outputs[0].token_ids for o in half.generate(prompts, params)]
    first_token_agreement = sum(a[0] == b[0] for a, b in zip(fp32, bf16)) / len(prompts)
    assert first_token_agreement >= 0.5, first_token_agreement


def test_cuda_graph_support_follows_the_expert_form(moe_model_dirs):
    """The engine captures CUDA graphs only while experts run on grouped_mm (no host sync)."""
    from tokenmill.models.model_loader.loader import load_model

    model, _ = load_model(moe_model_dirs["mixtral"], torch.float32, torch.device("cpu"), progress=False)
    assert model.supports_cuda_graphs
    model.layers[0].mlp.experts.linear_method = UNQUANTIZED
    split_experts(model)  # what quantized experts do
    assert not model.supports_cuda_graphs
