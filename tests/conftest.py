"""Shared fixtures: small models built locally (nothing is downloaded) and HF references."""

from __future__ import annotations

import os
import random
from pathlib import Path

# Set before torch (and so libgomp) loads, here and in every process the tests start (server
# subprocesses, pytest-xdist workers): OpenMP's threads sleep when they run out of work instead of
# spinning. With the default active wait, a process whose OpenMP threads share the cores with another
# busy process (a server and its client, two test workers) runs several times slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

# The shared `tokenmill serve` (and its log directory) for every test that asks for `server`: fixtures
# defined here exist once per run, whereas each module importing them would start its own.
from tests.utils.server import server_fixture, server_log_dir_fixture  # noqa: F401 - pytest fixtures

# Test tiers (markers registered in pyproject.toml; the Makefile's test targets select by them).
# Every test is in exactly one of `unit` (no engine, no server: functions, kernels against
# references, parsers, manifests), `engine` (builds an engine in this process) and `server` (talks to
# a running server): its own mark, else its module's `pytestmark`, else its folder's tier below.
TIERS = ("unit", "engine", "server")
FOLDER_TIERS = {
    "bench": "unit",
    "cli": "unit",
    "deploy": "unit",
    "engine": "engine",
    "examples": "engine",
    "export": "engine",
    "gpu": "engine",
    "kernels": "unit",
    "lora": "engine",
    "models": "engine",
    "server": "server",
    "stress": "server",
}


def pytest_collection_modifyitems(config, items) -> None:
    tests_root = Path(__file__).parent
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) > 1:  # (a module of mixed tiers marks its tests, not the module)
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(sorted(tiers))}: a test is in one tier")
        if not tiers:
            item.add_marker(FOLDER_TIERS.get(Path(item.path).relative_to(tests_root).parts[0], "unit"))


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run the full-size stress tests in tests/stress (>10 minutes); default: short versions",
    )


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> bool:
    """Build tokenmill's C++ CPU kernels (tokenmill/kernels) once, here, before any test: engines
    in this process and server subprocesses then load the cached build instead of compiling it
    inside a timed server start."""
    from tokenmill.kernels.build import load

    return load()


# HF's random init (std 0.02) makes attention nearly uniform, so a wrong scale, mask or bias in
# attention barely moves the output. Exactness fixtures rescale the random weights so attention is
# sharp (logits of std ~GAIN**2: the top key takes ~60% of the weight) and such bugs change
# greedy tokens; vectors (biases, norm weights) get noise so that they matter too.
SHARPEN_GAIN = 2.0
SHARPEN_NOISE = 0.2


def sharpen_weights(
    model: torch.nn.Module, seed: int = 0, gain: float = SHARPEN_GAIN, noise: float = SHARPEN_NOISE
) -> torch.nn.Module:
    """Any HF model, in place: every matrix (embeddings too) scaled from the init std to
    gain / sqrt(hidden_size); N(0, noise) added to other vectors. q/k RMSNorm weights (Qwen3,
    Gemma3, ...) alone set how sharp attention is (they fix |q| and |k|), so they are scaled to ~gain."""
    config = model.config.get_text_config()
    matrix_scale = gain / (config.hidden_size**0.5 * getattr(config, "initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters appear once
            if param.dim() >= 2:
                param.mul_(matrix_scale)
                continue
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # Standard RMSNorm weights start at 1; Gemma's (1 + w) ones at 0.
                param.add_(gain - 1) if param.abs().mean() < 0.5 else param.mul_(gain)
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * noise)
    return model


def agree_up_to_near_ties(got: list, expected: list, tolerance: float = 1e-4) -> int:
    """Asserts that greedy outputs (CompletionOutputs with logprobs >= 2) of two engine paths that
    compute the same arithmetic in a different order agree token for token, except that a sequence
    may part where the two paths' top two candidates were within `tolerance` of each other in both
    (a tie that fp32 rounding decides); nothing is compared after that. Returns how many parted."""
    parted = 0
    for a, b in zip(got, expected, strict=True):
        if a.token_ids == b.token_ids:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        pair = {a.token_ids[i], b.token_ids[i]}
        for _, top in (a.logprobs[i], b.logprobs[i]):  # (the chosen token's logprob, {top token: logprob})
            assert pair <= set(top), f"position {i}: {pair} are not both top candidates ({top})"
            first, second = (top[t] for t in pair)
            assert abs(first - second) <= tolerance, f"position {i}: parted without a near-tie ({top})"
        parted += 1
    return parted


def sharpen_saved_model(model_dir: Path, seed: int = 0) -> Path:
    """Load a saved HF model, sharpen its weights and save it back over the same directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sharpen_weights(model, seed).save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def save_random_model(config, tokenizer_dir: Path, target: Path, seed: int, sharpen: bool = True) -> Path:
    """A random-init HF model of `config` (sharpened unless told otherwise) with the given tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if sharpen:
        sharpen_weights(model, seed)
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tokenmill.models.model_loader.hub import default_model_dir as resolve

    return resolve()


CHAT_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "2+2=")


@pytest.fixture(scope="session")
def default_model_chat_answers() -> tuple[list[list[int]], list]:
    """The default model's fp32 greedy answers (24 tokens, top-2 logprobs) to `CHAT_QUESTIONS` in
    its chat template: (prompt token ids, CompletionOutput per prompt). Generated once per run, for the
    tests that check them against HF and measure int8 against them (the 135M model takes seconds to load)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(None, progress=False, kv_cache_memory="64MiB", dtype="float32")  # (auto is bf16 on AMX CPUs)
    chats = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    encoded = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in encoded]
    answers = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2))]
    llm.engine.close()
    return prompts, answers


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, request) -> Path:
    """`tokenmill make-tiny-model` (HF default init: soft attention, soft logits), for tests of engine
    and server behaviour (penalties, stop strings, ...). Exactness tests use `sharp_tiny_model_dir`."""
    from tokenmill.models.model_loader.hub import make_tiny_model

    # $TOKENMILL_TEST_TOKENIZER: a tokenizer directory, for machines without the bundled model
    # (bench/gpu_check.sh on a GPU machine); otherwise the default model's tokenizer.
    tokenizer = os.environ.get("TOKENMILL_TEST_TOKENIZER") or request.getfixturevalue("default_model_dir")
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir=tokenizer)


@pytest.fixture(scope="session")
def sharp_tiny_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama with sharpened weights (see `sharpen_weights`), for exactness tests."""
    import shutil

    target = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("sharp-tiny-llama") / "model"))
    return sharpen_saved_model(target)


@pytest.fixture(scope="session")
def bf16_sharp_tiny_model_dir(tmp_path_factory, sharp_tiny_model_dir) -> Path:
    """The sharp tiny Llama published in bf16 (its weights rounded to bf16, as most HF checkpoints
    ship): loaded in fp32, every weight is a bf16 value."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    target = Path(shutil.copytree(sharp_tiny_model_dir, tmp_path_factory.mktemp("bf16-sharp-tiny-llama") / "model"))
    for path in target.glob("*.safetensors"):
        save_file({k: v.bfloat16().contiguous() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config.pop("dtype", None)
    (target / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return target


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, default_model_dir) -> Path:
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=49152, n_positions=1024, n_embd=128, n_layer=3, n_head=4, bos_token_id=1, eos_token_id=2
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-gpt2"), seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, default_model_dir) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-qwen2"), seed=2)


@pytest.fixture(scope="session")
def tiny_llama_bias_dir(tmp_path_factory, default_model_dir) -> Path:
    """Llama with attention_bias (HF: biases on q, k, v *and* o_proj) and mlp_bias."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_bias=True,
        mlp_bias=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-llama-bias"), seed=3)


@pytest.fixture(scope="session")
def tiny_gpt2_unscaled_dir(tmp_path_factory, default_model_dir) -> Path:
    """GPT-2 without the 1/sqrt(d) attention scale, scaled by 1/(layer + 1) instead."""
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=49152,
        n_positions=512,
        n_embd=64,
        n_layer=3,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
        scale_attn_weights=False,
        scale_attn_by_inverse_layer_idx=True,
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-gpt2-unscaled"), seed=4)


# Sliding-window fixtures: windows far shorter than the test prompts (up to ~60-90 tokens).
TEST_WINDOW = 12


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, default_model_dir) -> Path:
    """Mistral: a sliding window on every layer."""
    from transformers import MistralConfig

    config = MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=TEST_WINDOW,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-mistral"), seed=6)


@pytest.fixture(scope="session")
def tiny_qwen2_window_dir(tmp_path_factory, default_model_dir) -> Path:
    """Qwen2 with use_sliding_window: layers >= max_window_layers slide, the ones below attend fully."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=TEST_WINDOW,
        max_window_layers=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("tiny-qwen2-window"), seed=7)


def mixed_prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (ids from the common range of the SmolLM2 vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def run_staggered(llm, prompts: list[list[int]], params, per_step: int = 2, pick=lambda out: out.token_ids) -> list:
    """Greedy tokens of each prompt with `per_step` new requests joining each engine step, so
    requests join a batch that is already decoding (batches of many sizes and context widths).
    `pick`: what of each prompt's CompletionOutput to return (its token ids)."""
    engine, pending, done = llm.engine, list(enumerate(prompts)), {}
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = pick(out.outputs[0])
    return [done[i] for i in range(len(prompts))]


_HF_CACHE: dict = {}


def _hf_model(model_dir: Path):
    """The transformers fp32 model of `model_dir`, loaded once per run."""
    from transformers import AutoModelForCausalLM

    model = _HF_CACHE.get(str(model_dir))
    if model is None:
        model = _HF_CACHE[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference: transformers generate(do_sample=False), one prompt at a time, no padding."""
    key = (str(model_dir), tuple(prompt_ids), max_new_tokens)
    if key not in _HF_CACHE:
        with torch.inference_mode():
            out = _hf_model(model_dir).generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        _HF_CACHE[key] = out[0, len(prompt_ids) :].tolist()
    return _HF_CACHE[key]


def hf_greedy_batch(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """`hf_greedy` of each prompt (the same cache), the ones not yet cached computed by
    `hf_greedy_padded` `batch_size` prompts at a time, prompts of similar length together."""

    def key(prompt) -> tuple:
        return (str(model_dir), tuple(prompt), max_new_tokens)

    todo = sorted({tuple(p) for p in prompts if key(p) not in _HF_CACHE}, key=len)
    for start in range(0, len(todo), batch_size):
        batch = [list(p) for p in todo[start : start + batch_size]]
        for prompt, tokens in zip(batch, hf_greedy_padded(model_dir, batch, max_new_tokens)):
            _HF_CACHE[key(prompt)] = tokens
    return [_HF_CACHE[key(p)] for p in prompts]


def hf_greedy_padded(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` of several prompts in one left-padded generate() call (uncached): a decode step
    of a small model reads all its weights for one token, so one prompt at a time costs about as
    many times as much. The padding is masked out and each row keeps its own positions, so a row's
    tokens are its unpadded reference's (test_engine_exactness.py checks that on every run); a row
    that ends at EOS is cut there, as generate() stops there for one prompt. Not for models whose
    positions depend on the padded length (Phi-3's LongRoPE picks its factors by sequence length)."""
    model = _hf_model(model_dir)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    results = []
    for row in range(len(prompts)):
        tokens = out[row, width:].tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos_ids]
        results.append(tokens[: ends[0] + 1] if ends else tokens)
    return results


def hf_forward(model_dir: Path, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one unpadded fp32 forward pass -> (log-softmax of the logits [T, V], final hidden
    states [T, H], the final norm's output as `output_hidden_states` reports it)."""
    with torch.inference_mode():
        out = _hf_model(model_dir)(torch.tensor([prompt_ids]), output_hidden_states=True)
    return out.logits[0].float().log_softmax(-1), out.hidden_states[-1][0]
