"""Multi-LoRA in the engine: adapters made with `peft` on the sharpened tiny models, each request's
greedy tokens equal to HF generate with peft applying that request's adapter (fp32), in batches
that mix adapters and the base model; LRU slot swapping; prefix caching per adapter; bad adapters."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import mixed_prompts
from tests.utils.lora import make_peft_adapter, peft_greedy, peft_last_hidden
from tokenmill import LLM, LoRARequest, PoolingParams, SamplingParams
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.lora import layers as lora_layers
from tokenmill.lora.layers import LoRALinear
from tokenmill.lora.registry import LoRAError

pytest.importorskip("peft")

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory, sharp_tiny_model_dir) -> dict[str, Path]:
    """Three adapters of the tiny Llama that differ in every way the reader must get right."""
    root = tmp_path_factory.mktemp("llama-adapters")
    return {
        # Every projection, placed into the fused qkv and gate_up layers.
        "all": make_peft_adapter(
            sharp_tiny_model_dir, root / "all", seed=1, r=8, lora_alpha=16, target_modules=ATTENTION + MLP
        ),
        # rsLoRA scaling (alpha / sqrt(r)), only q and v: k's slice of the fused layer stays untouched.
        "qv": make_peft_adapter(
            sharp_tiny_model_dir,
            root / "qv",
            seed=2,
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
        ),
        # The largest rank, per-module ranks and alphas, some layers only.
        "mixed": make_peft_adapter(
            sharp_tiny_model_dir,
            root / "mixed",
            seed=3,
            r=16,
            lora_alpha=32,
            target_modules=["o_proj", "gate_proj", "down_proj", "k_proj"],
            rank_pattern={"down_proj": 2},
            alpha_pattern={"o_proj": 4},
            layers_to_transform=[0, 2, 3, 5],
        ),
    }


def _requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    """The adapters in turn, and the base model (None)."""
    return [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())] + [None]


def _refuse(*args, **kwargs):
    raise AssertionError("a GEMM path ran where the CPU kernel should have")


def _counted(method, name: str, calls: dict[str, int]):
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return method(*args, **kwargs)

    return wrapper


def _check_against_peft(model_dir: Path, outputs, prompts, choices) -> None:
    for i, (prompt, out, choice) in enumerate(zip(prompts, outputs, choices)):
        adapter = None if choice is None else Path(choice.lora_path)
        expected = peft_greedy(model_dir, adapter, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"prompt {i} ({len(prompt)} tokens), adapter {adapter}"


def _adapters_matter(model_dir: Path, prompts: list[list[int]], choices: list[LoRARequest | None]) -> None:
    """The test could fail: every adapter changes the greedy tokens of the prompts it served."""
    for prompt, choice in zip(prompts, choices):
        if choice is not None:
            adapted = peft_greedy(model_dir, Path(choice.lora_path), prompt, MAX_TOKENS)
            assert adapted != peft_greedy(model_dir, None, prompt, MAX_TOKENS), f"{choice.lora_name} changes nothing"


@pytest.mark.parametrize("path", ["kernel", "gemm"])
def test_mixed_adapter_batch_matches_peft(sharp_tiny_model_dir, llama_adapters, path, monkeypatch):
    """One batch: 3 adapters and the base model, chunked prefill mixed with decodes; the deltas
    computed by the CPU kernel, or by the GEMM paths (padded batched GEMMs for even groups, grouped
    GEMMs for uneven ones) that GPUs and bf16 take."""
    if path == "kernel":
        if not cpu_kernels_available(torch.device("cpu")):
            pytest.skip("tokenmill's CPU kernels are not available here")
        for gemm_path in ("_batched", "_matmul"):  # the kernel must serve every step
            monkeypatch.setattr(LoRALinear, gemm_path, _refuse)
    gemm_calls: dict[str, int] = {}
    if path == "gemm":
        monkeypatch.setattr(lora_layers, "cpu_kernels_available", lambda device: False)
        for gemm_path in ("_batched", "_matmul"):
            monkeypatch.setattr(LoRALinear, gemm_path, _counted(getattr(LoRALinear, gemm_path), gemm_path, gemm_calls))
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="64MiB",
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_num_batched_tokens=96,
    )
    prompts = mixed_prompts(8, 3, 60, seed=11)
    choices = [_requests(llama_adapters)[i % 4] for i in range(len(prompts))]
    steps_mixing = []
    llm.engine.step_listeners.append(lambda stats: steps_mixing.append(stats.batch_size))
    outputs = llm.generate(prompts, GREEDY, lora_request=choices)
    _check_against_peft(sharp_tiny_model_dir, outputs, prompts, choices)
    _adapters_matter(sharp_tiny_model_dir, prompts, choices)
    if path == "gemm":  # both GEMM paths served steps
        assert gemm_calls.get("_batched", 0) > 0 and gemm_calls.get("_matmul", 0) > 0, gemm_calls
    assert max(steps_mixing) >= 6  # the requests really ran batched together
    assert sorted(a.name for a in llm.engine.loras.adapters()) == sorted(llama_adapters)


def test_fewer_slots_than_adapters_swaps_lru(sharp_tiny_model_dir, llama_adapters):
    """--max-loras 2 with 3 adapters (and base requests): adapters wait for a slot, are swapped in
    and out from CPU memory, and every request still gets its own adapter."""
    prompts = mixed_prompts(8, 3, 30, seed=12)
    choices = [_requests(llama_adapters)[i % 4] for i in range(len(prompts))]
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="64MiB",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    model = llm.engine.lora_model
    loads, begin = [], model.begin

    def counting_begin(batch, device):
        assert len(batch.adapters) <= 2
        loads.extend(slot for slot, adapter in batch.adapters if model.resident[slot] != adapter.id)
        return begin(batch, device)

    model.begin = counting_begin
    _check_against_peft(sharp_tiny_model_dir, llm.generate(prompts, GREEDY, lora_request=choices), prompts, choices)
    assert len(loads) >= 3 and set(loads) == {0, 1}  # 3 adapters through 2 slots: one was evicted


def test_adapters_with_speculative_decoding(sharp_tiny_model_dir, llama_adapters):
    """Speculative steps verify several tokens per sequence in one forward pass: each of them gets
    its sequence's adapter, and greedy output stays peft's. (The base model drafts: its proposals
    are always there, and the adapters' requests reject some of them.)"""
    prompts = mixed_prompts(4, 5, 30, seed=15)
    choices = [_requests(llama_adapters)[i % 4] for i in range(len(prompts))]
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="64MiB",
        dtype="float32",
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        speculative_method="draft",
        speculative_model=str(sharp_tiny_model_dir),
        num_speculative_tokens=3,
    )
    _check_against_peft(sharp_tiny_model_dir, llm.generate(prompts, GREEDY, lora_request=choices), prompts, choices)
    stats = llm.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_prefix_cache_is_per_adapter(sharp_tiny_model_dir, llama_adapters):
    """The same prompt under the base model and two adapters: KV blocks are only reused by requests
    of the same adapter, and every output stays exact."""
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="64MiB",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    prompt = mixed_prompts(1, 70, 70, seed=13)[0]
    adapter_all = LoRARequest("all", 1, str(llama_adapters["all"]))
    adapter_qv = LoRARequest("qv", 2, str(llama_adapters["qv"]))
    runs = [None, adapter_all, adapter_qv, adapter_all, None]
    cached = []
    for choice in runs:  # one at a time, so every earlier request's blocks are in the cache
        out = llm.generate([prompt], GREEDY, lora_request=choice)[0]
        _check_against_peft(sharp_tiny_model_dir, [out], [prompt], [choice])
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]  # a new adapter never takes the base model's (or another's) blocks
    assert cached[3] == cached[4] == 64  # its own blocks, and the base model's, are reused


def test_embeddings_with_adapters(sharp_tiny_model_dir, llama_adapters):
    """An embedding request pools the hidden states of its adapter's model (peft's, 1e-4 in fp32)."""
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="16MiB",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    prompts = mixed_prompts(4, 5, 30, seed=16)
    choices = [_requests(llama_adapters)[i % 4] for i in range(len(prompts))]
    vectors = llm.embed(prompts, PoolingParams("last", normalize=False), lora_request=choices)
    for prompt, vector, choice in zip(prompts, vectors, choices):
        adapter = None if choice is None else Path(choice.lora_path)
        expected = peft_last_hidden(sharp_tiny_model_dir, adapter, prompt)
        torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-4, rtol=1e-4)
        if adapter is not None:
            assert not torch.allclose(expected, peft_last_hidden(sharp_tiny_model_dir, None, prompt), atol=1e-2)


def test_result_cache_is_per_adapter(sharp_tiny_model_dir, llama_adapters):
    """--result-cache-size: a repeat is answered from memory only under the same adapter."""
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="16MiB",
        dtype="float32",
        enable_lora=True,
        max_lora_rank=16,
        result_cache_size=8,
    )
    prompt = mixed_prompts(1, 20, 20, seed=18)[0]
    adapter = LoRARequest("all", 1, str(llama_adapters["all"]))
    for choice, hits in ((None, 0), (adapter, 0), (adapter, 1), (None, 2)):
        _check_against_peft(
            sharp_tiny_model_dir, llm.generate([prompt], GREEDY, lora_request=choice), [prompt], [choice]
        )
        assert llm.engine.stats().result_cache_hits_total == hits


def test_qwen2_adapters_match_peft(tiny_qwen2_dir, tmp_path):
    """A second family (q/k/v biases, RoPE scaling): two adapters and the base in one batch."""
    adapters = {
        "attn": make_peft_adapter(
            tiny_qwen2_dir, tmp_path / "attn", seed=4, r=8, lora_alpha=8, target_modules=ATTENTION
        ),
        "mlp": make_peft_adapter(tiny_qwen2_dir, tmp_path / "mlp", seed=5, r=4, lora_alpha=16, target_modules=MLP),
    }
    llm = LLM(
        str(tiny_qwen2_dir),
        progress=False,
        kv_cache_memory="64MiB",
        dtype="float32",
        max_loras=2,
        lora_modules=[f"{name}={path}" for name, path in adapters.items()],
    )
    prompts = mixed_prompts(6, 2, 50, seed=14)
    choices = [_requests(adapters)[i % 3] for i in range(len(prompts))]
    _check_against_peft(tiny_qwen2_dir, llm.generate(prompts, GREEDY, lora_request=choices), prompts, choices)
    _adapters_matter(tiny_qwen2_dir, prompts, choices)


def test_phi3_fused_targets_match_peft(tmp_path, default_model_dir):
    """Phi-3's checkpoints fuse q/k/v and gate/up: adapters target `qkv_proj` and `gate_up_proj`
    whole, and their B matrices span every part of the fused layer."""
    from tests.conftest import save_random_model
    from tests.models.test_native_families import _phi3

    model_dir = save_random_model(_phi3(), default_model_dir, tmp_path / "phi3", seed=17)
    adapter = make_peft_adapter(
        model_dir,
        tmp_path / "fused",
        seed=6,
        r=8,
        lora_alpha=16,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    )
    llm = LLM(
        str(model_dir), progress=False, kv_cache_memory="16MiB", dtype="float32", lora_modules=[f"fused={adapter}"]
    )
    # (longer than LongRoPE's original 32 positions, where HF and tokenmill use the same factors)
    prompts = mixed_prompts(4, 40, 60, seed=17)
    choices = [LoRARequest("fused", 1, str(adapter)) if i % 2 else None for i in range(len(prompts))]
    _check_against_peft(model_dir, llm.generate(prompts, GREEDY, lora_request=choices), prompts, choices)
    _adapters_matter(model_dir, prompts, choices)


# ---------------------------------------------------------------------------------------------- bad adapters


@pytest.fixture(scope="module")
def lora_llm(sharp_tiny_model_dir) -> LLM:
    return LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="16MiB",
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
    )


def _broken_copy(source: Path, target: Path, *, config: dict | None = None, tensors=None) -> Path:
    """A copy of an adapter with its config updated and/or its tensors transformed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if config is not None:
        path = target / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        file = target / "adapter_model.safetensors"
        save_file({k: v.contiguous() for k, v in tensors(load_file(str(file))).items()}, str(file))
    return target


def _renamed(old: str, new: str):
    return lambda state: {k.replace(old, new): v for k, v in state.items()}


BAD_ADAPTERS = {  # changes to the rank-4 "qv" adapter (q_proj and v_proj of every layer)
    "a layer the model lacks": (dict(tensors=_renamed("layers.5.", "layers.9.")), "model.layers.9.self_attn"),
    "an embedding adapter": (dict(tensors=_renamed("layers.0.self_attn.q_proj", "embed_tokens")), "embed_tokens"),
    "B of another rank": (
        dict(tensors=lambda s: {k: v[:, :3] if "lora_B" in k else v for k, v in s.items()}),
        "are not a [r, in] / [out, r] pair",
    ),
    "another base model's shapes": (
        dict(tensors=lambda s: {k: torch.zeros(v.shape[0], 64) if "lora_A" in k else v for k, v in s.items()}),
        "do not fit the model's layer",
    ),
    "A without B": (
        dict(tensors=lambda s: {k: v for k, v in s.items() if "layers.0.self_attn.q_proj.lora_B" not in k}),
        "has no lora_B",
    ),
    "no matrices": (dict(tensors=lambda s: {}), "holds no LoRA matrices"),
    "NaN weights": (dict(tensors=lambda s: {k: v * float("nan") for k, v in s.items()}), "NaN or infinite"),
    "DoRA": (dict(config={"use_dora": True}), "DoRA adapters are not supported"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "trained biases": (dict(config={"bias": "all"}), "bias='all'"),
    "another PEFT method": (dict(config={"peft_type": "IA3"}), "peft_type 'IA3' is not supported"),
    # Hostile or corrupt files: a clear refusal, never a ZeroDivisionError / TypeError (HTTP 500) or
    # weights that are silently infinite.
    "rank 0": (dict(tensors=lambda s: {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in s.items()}), "has rank 0"),
    "lora_alpha NaN": (dict(config={"lora_alpha": float("nan")}), "needs a positive number 'lora_alpha'"),
    "lora_alpha infinite": (dict(config={"lora_alpha": float("inf")}), "needs a positive number 'lora_alpha'"),
    "scaled B overflows": (dict(config={"lora_alpha": 1e300}), "NaN or infinite"),
    "alpha_pattern not an object": (dict(config={"alpha_pattern": ["q_proj"]}), "alpha_pattern must be"),
    "alpha_pattern value not a number": (dict(config={"alpha_pattern": {"q_proj": "x"}}), "alpha_pattern must be"),
    "alpha_pattern bad regex": (dict(config={"alpha_pattern": {"q_proj(": 4}}), "alpha_pattern must be"),
    "rank_pattern bad regex": (dict(config={"rank_pattern": {"q_proj(": 4}}), "rank_pattern must be"),
    "too many alpha_pattern keys": (
        dict(config={"alpha_pattern": {f"layers.{i}.q_proj": 4 for i in range(257)}}),
        "it has 257 keys, more than 256",
    ),
    "alpha_pattern key too long": (
        dict(config={"alpha_pattern": {"q" * 513: 4}}),
        "is longer than 512 characters",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapter_is_refused_naming_the_problem(case, lora_llm, llama_adapters, tmp_path):
    changes, message = BAD_ADAPTERS[case]
    broken = _broken_copy(llama_adapters["qv"], tmp_path / "broken", **changes)
    with pytest.raises(LoRAError, match=re.escape(message)) as info:
        lora_llm.engine.loras.load("bad", broken)
    assert "'bad'" in str(info.value) and "\n" not in str(info.value)
    assert lora_llm.engine.loras.get("bad") is None


# A regex that backtracks for ever under `re` (2^31 ways to match a 31-character module name).
CATASTROPHIC_PATTERN = "(.|.)*X"


def test_a_catastrophic_alpha_pattern_cannot_freeze_the_process(sharp_tiny_model_dir, llama_adapters, tmp_path):
    """In a child process (`re` would hold the GIL: no thread could time it out): the adapter loads
    within the hang limit, the pattern matching no module (so lora_alpha applies)."""
    hostile = _broken_copy(
        llama_adapters["qv"], tmp_path / "hostile", config={"alpha_pattern": {CATASTROPHIC_PATTERN: 8}}
    )
    script = (
        "from tokenmill import LLM\n"
        f"llm = LLM({str(sharp_tiny_model_dir)!r}, progress=False, kv_cache_memory='16MiB', dtype='float32', "
        "enable_lora=True, max_lora_rank=8)\n"
        f"print('rank', llm.engine.loras.load('hostile', {str(hostile)!r}).rank)\n"
    )
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading an adapter with alpha_pattern {CATASTROPHIC_PATTERN!r} hung")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rank 4" in result.stdout


def test_alpha_patterns_past_the_match_budget_are_refused_naming_the_key(
    lora_llm, llama_adapters, tmp_path, monkeypatch
):
    from tokenmill.lora import registry

    monkeypatch.setattr(registry, "PATTERN_MATCH_BUDGET_S", 0.0)
    slow = _broken_copy(llama_adapters["qv"], tmp_path / "slow", config={"alpha_pattern": {CATASTROPHIC_PATTERN: 8}})
    with pytest.raises(LoRAError, match=re.escape(f"alpha_pattern key {CATASTROPHIC_PATTERN!r} takes too long")):
        lora_llm.engine.loras.load("slow", slow)
    assert lora_llm.engine.loras.get("slow") is None


def test_rank_over_max_lora_rank(lora_llm, llama_adapters):
    with pytest.raises(LoRAError, match="gate_proj has rank 16, more than --max-lora-rank 8"):
        lora_llm.engine.loras.load("big", llama_adapters["mixed"])
    lora_llm.engine.loras.load("fits", llama_adapters["qv"])  # rank 4: fine
    with pytest.raises(LoRAError, match="already been loaded"):
        lora_llm.engine.loras.load("fits", llama_adapters["qv"])
    lora_llm.engine.loras.unload("fits")


def test_missing_adapter_files(lora_llm, tmp_path):
    with pytest.raises(LoRAError, match="no such directory"):
        lora_llm.engine.loras.load("nothing", tmp_path / "nothing")
    with pytest.raises(LoRAError, match="adapter_config.json is missing"):
        lora_llm.engine.loras.load("empty", tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    with pytest.raises(LoRAError, match="no adapter_model.safetensors or adapter_model.bin"):
        lora_llm.engine.loras.load("no-weights", tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="adapter_model.safetensors is unreadable"):
        lora_llm.engine.loras.load("garbage", tmp_path)


def test_a_bin_weights_file_must_hold_named_tensors(lora_llm, tmp_path):
    """adapter_model.bin is a pickle: one that holds a list, or a dict of non-tensors, is refused
    (not an AttributeError: HTTP 500)."""
    (tmp_path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    for content in ([1, 2], {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 3}):
        torch.save(content, tmp_path / "adapter_model.bin")
        with pytest.raises(LoRAError, match="adapter_model.bin must hold a dict of named tensors"):
            lora_llm.engine.loras.load("pickled", tmp_path)


def test_startup_refuses_a_bad_adapter_in_one_line(sharp_tiny_model_dir, tmp_path):
    """`--lora-modules` with a broken adapter: exit code 2 and a line naming the adapter and the problem."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "generate",
            "--model",
            str(sharp_tiny_model_dir),
            "--kv-cache-memory",
            "16MiB",
            "--lora-modules",
            f"broken={tmp_path}",
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert f"LoRA adapter 'broken' ({tmp_path}): adapter_config.json is missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_lora_settings_refused_upfront(sharp_tiny_model_dir, llama_adapters):
    with pytest.raises(ValueError, match="--max-loras must be >= 1"):
        LLM(str(sharp_tiny_model_dir), progress=False, enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="not supported with --compile"):
        LLM(str(sharp_tiny_model_dir), progress=False, enable_lora=True, compile=True)
    with pytest.raises(ValueError, match="must be NAME=PATH"):
        LLM(str(sharp_tiny_model_dir), progress=False, lora_modules=["just-a-path"])
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="16MiB").generate(
            [[5, 6]], GREEDY, lora_request=LoRARequest("all", 1, str(llama_adapters["all"]))
        )
    # Slots larger than the machine's memory: the flags are named, before anything is allocated.
    with pytest.raises(ValueError, match=r"--max-loras 100000 x --max-lora-rank 4096 need .* GiB"):
        LLM(str(sharp_tiny_model_dir), progress=False, enable_lora=True, max_loras=100000, max_lora_rank=4096)


def test_runtime_updates_flag_needs_lora(sharp_tiny_model_dir):
    """`serve --enable-lora-runtime-updates` without LoRA slots: exit code 2 naming both flags."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--model",
            str(sharp_tiny_model_dir),
            "--enable-lora-runtime-updates",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "--enable-lora-runtime-updates needs --enable-lora" in result.stderr
    assert "Traceback" not in result.stderr


def test_generic_path_refuses_lora(tiny_qwen2_dir):
    with pytest.raises(ValueError, match="no layers LoRA adapters can target"):
        LLM(str(tiny_qwen2_dir), progress=False, kv_cache_memory="16MiB", model_impl="transformers", enable_lora=True)


# ---------------------------------------------------------------------------------------------- slot plans


@pytest.mark.unit
def test_slot_plan_groups_rows_by_slot_and_evicts_lru():
    from tokenmill.lora.batch import LoRASlots
    from tokenmill.lora.types import LoRAAdapter

    a, b, c = (LoRAAdapter(name, "", i, 4, {}) for i, name in enumerate("abc", start=1))
    slots = LoRASlots(2)
    assert slots.plan([(None, 5)]) is None  # the base model alone: no LoRA work at all
    plan = slots.plan([(a, 3), (None, 2), (b, 1), (a, 1)])
    assert plan.token_slots.tolist() == [0, 0, 0, -1, -1, 1, 0]
    assert plan.rows.tolist() == [0, 1, 2, 6, 5]  # slot 0's rows in token order, then slot 1's; base rows none
    assert plan.slot_range == (0, 2) and plan.offsets.tolist() == [4, 5]
    assert plan.segments == ((0, 0, 4), (1, 4, 5))
    assert plan.adapters == ((0, a), (1, b))
    assert plan.padded is None  # groups of 4 and 1 rows: padding would double the work
    even = slots.plan([(a, 2), (b, 1), (None, 1), (b, 1), (a, 1)])  # decodes: groups of 3 and 2 rows
    gather, valid = even.padded
    assert even.rows.tolist() == [0, 1, 5, 2, 4]
    assert gather.tolist() == [0, 1, 5, 2, 4, 2] and valid.tolist() == [0, 1, 2, 3, 4]  # b's block padded
    slots.plan([(b, 1)])  # b is now the most recently used
    only_c = slots.plan([(c, 2)])
    assert only_c.adapters == ((0, c),)  # a (least recently used) gave up its slot
    assert only_c.slot_range == (0, 1) and only_c.offsets.tolist() == [2]  # GEMMs over slot 0 only
    assert slots.plan([(a, 1), (c, 1)]).adapters == ((0, c), (1, a))  # b goes: c is needed by this step
    with pytest.raises(RuntimeError, match="only 2 slots"):
        slots.plan([(a, 1), (b, 1), (c, 1)])
