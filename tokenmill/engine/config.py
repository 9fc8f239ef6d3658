"""Engine settings: one dataclass shared by the CLI, the server and the offline API."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tokenmill.models.model_loader.hf_hub import HubOptions
from tokenmill.options import add_options, from_args, option

# The offline API's defaults (LLM, the offline benchmarks) where they differ from the server's
# (EngineConfig's below), as vLLM's LLM class on CPU: all requests are known up front, so larger steps
# (GEMMs at a better rate) keep no client waiting (`tokenmill bench offline --max-num-batched-tokens
# 2048` against the default measures the difference).
OFFLINE_DEFAULTS = {"max_num_batched_tokens": 4096, "max_num_seqs": 256}


@dataclass
class EngineConfig:
    model: str | None = option(
        None,
        "the model: a hub repository id (ORG/NAME: from the local Hugging Face cache, else downloaded), a "
        "local Hugging Face model directory, or a .gguf file (converted once, cached) (default: the bundled "
        "SmolLM2-135M-Instruct)",
    )
    model_impl: str = option(
        "auto",
        "model code: native = tokenmill's own fast paths (listed by `tokenmill models`), transformers = "
        "the generic path running HF's modeling code with tokenmill's paged attention, auto = native when the "
        "architecture has one, else transformers",
        choices=["auto", "native", "transformers"],
    )
    revision: str | None = option(
        None, "--model ORG/NAME: the branch, tag or commit to use (default: the repository's main branch)"
    )
    tokenizer: str | None = option(
        None,
        "tokenizer (and chat template) to use instead of the model's: a local directory or a hub repository id "
        "(default: the model's own; a GGUF file's from its metadata)",
    )
    tokenizer_revision: str | None = option(None, "--tokenizer ORG/NAME: the branch, tag or commit to use")
    download_dir: str | None = option(
        None, "Hugging Face cache to read models from and download them into (default: $HF_HUB_CACHE)", metavar="DIR"
    )
    hf_token: str | bool | None = option(
        None,
        "token for gated or private hub repositories; without a value: the token `hf auth login` stored "
        "(default: $HF_TOKEN, else that stored token)",
        metavar="TOKEN",
        nargs="?",
        const=True,
        type=str,
    )
    trust_remote_code: bool = option(
        False, "refused: tokenmill never runs code from a model repository (it serves the families it implements)"
    )
    chat_template: str | None = option(
        None,
        "chat template to use instead of the tokenizer's: a Jinja file, or the template itself (as vLLM takes it)",
        metavar="FILE_OR_TEMPLATE",
    )
    generation_config: str = option(
        "auto",
        "default sampling settings of requests that do not set them: auto = the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; as vLLM), vllm = "
        "none (OpenAI's defaults), or a directory holding a generation_config.json",
        metavar="auto|vllm|DIR",
    )
    max_logprobs: int = option(
        20, "most logprobs (and prompt_logprobs) a request may ask for per token; -1 = no limit (as vLLM)"
    )
    served_model_name: list[str] | None = option(
        None,
        "name(s) the API serves the model under: requests may use any of them, responses and the metrics report "
        "the first (default: the repository id, or the directory's or GGUF file's name)",
        nargs="+",
        type=str,
        metavar="NAME",
    )
    dtype: str = option(
        "auto",
        "weight/activation dtype; auto = bf16 on a CPU with native bf16 (AMX or "
        "AVX512-BF16) for a model published in bf16/fp16, else fp32 on CPU; bf16 (or fp16) on GPU. "
        "bfloat16 on a CPU without native bf16: bf16 weights and KV cache, fp32 arithmetic (float, half: vLLM's "
        "names for float32, float16)",
        choices=["auto", "float32", "float16", "bfloat16", "float", "half"],
    )
    device: str = option("auto", "where to run; auto picks CUDA when available", choices=["auto", "cpu", "cuda"])
    quantization: str | None = option(
        None,
        "weight-only quantization of a float checkpoint's linear layers at load: int8 in groups of 32 inputs, "
        "each group's bf16 scale the least-error one; int4 in groups of 32, each an fp16 scale and offset of least "
        "error (the lm_head in int8); activations stay in --dtype. Pre-quantized checkpoints (GPTQ, AWQ, "
        "compressed-tensors, FP8) are detected from their config.json and need no flag (docs/quantization.md), as do "
        "a GGUF file's Q8_0, Q4_0 and Q4_1 layers (run with the file's own scales: docs/model-sources.md)",
        choices=["int8", "int4"],
    )
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_dtype: str = option(
        "auto",
        "dtype of the KV cache: auto = the model's; bfloat16/float16 under an fp32 model halve the "
        "cache's memory and the bytes attention reads per step (K/V rounded as written); int8 quarters them "
        "(each token's K/V row per head quantized with its own scale; not exact: see bench agreement)",
        choices=["auto", "float32", "float16", "bfloat16", "int8"],
    )
    kv_cache_memory: str | None = option(
        None, "KV cache budget, e.g. 512MiB or 2GiB (default: --kv-cache-memory-fraction of free memory)"
    )
    kv_cache_memory_fraction: float = option(
        0.3, "fraction of free device memory for the KV cache when --kv-cache-memory is unset"
    )
    max_num_seqs: int = option(128, "most sequences in one batch")
    max_num_batched_tokens: int = option(
        2048,
        "token budget per step (prefill chunks + decodes); larger steps run the GEMMs at a better rate "
        "and make decodes wait longer behind a prefill (2048: vLLM's default on CPU for its server)",
    )
    scheduling_policy: str = option(
        "fcfs",
        "which waiting request is admitted first: fcfs (arrival order) or priority (a request's `priority`, "
        "lower first, then arrival; the running request preempted for KV blocks is the last by that order)",
        choices=["fcfs", "priority"],
    )
    max_model_len: int | None = option(None, "context length limit (default: the model's)", type=int)
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    result_cache_size: int = option(
        0,
        "answer repeats of identical greedy or seeded requests from an LRU of the last N finished "
        "completions, without running the model (default: 0 = off)",
        metavar="N",
    )
    packed_linear: bool = option(
        True,
        "CPU only: pack the linear layers' weights once at load: fp32 on tokenmill's panel GEMM kernel "
        "(faster than oneDNN's packed fp32 and MKL's default path: `tokenmill bench kernels`), bf16 on oneDNN "
        "where the CPU has native bf16 (AMX / AVX512-BF16), else on the same panel GEMM (widened to fp32 as it "
        "streams); with --quantization, the layers it keeps in float (the lm_head, held in bf16 on the panel GEMM "
        "where the CPU has no native bf16). Ignored with --compile and on GPU (--onednn-linear: old name)",
        aliases=("--onednn-linear",),
    )
    fused_layers: bool = option(
        True,
        "CPU, projections on tokenmill's kernels (--packed-linear, --quantization, quantized checkpoints: int8, "
        "4-bit, W8A8, FP8): run each Llama-shaped decoder layer of a decode step as one C++ call (the same "
        "kernels in the same order, without the Python between them: bit-identical results)",
    )
    # None = auto: see engine/setup.py's batch_invariance.
    batch_invariant: bool | None = option(
        None,
        "each request's output independent of what else shares its steps: how many rows a step has, where "
        "the request's rows sit, how its context is split into chunks (chunked prefill, prefix-cache hits, "
        "preemption) and whether speculation verifies them (greedy output with speculation = without); "
        "row-invariant GEMMs, every prompt chunk on the paged attention kernel (default: on with tokenmill's CPU "
        "kernels where it costs little; per CPU kind, and what it costs: docs/batch-invariance.md)",
        action=argparse.BooleanOptionalAction,
    )
    compile: bool = option(
        False, "torch.compile the dense parts of the model step (dynamic token count; attention stays eager)"
    )
    cuda_graphs: bool = option(
        False,
        "GPU only: replay decode-only steps as CUDA graphs, one per (batch size, context length) bucket, "
        "captured on first use; other steps run eagerly. Ignored on CPU and with --tensor-parallel-size > 1",
        action=argparse.BooleanOptionalAction,
    )
    # None = auto: on with CUDA; off on CPU, where the model's threads already use every core.
    overlap_scheduling: bool | None = option(
        None,
        "run the model on its own thread, one step ahead: step N+1 is scheduled and prepared, and step "
        "N's tokens detokenized and streamed, while the model runs step N (default: on with CUDA; off on CPU, "
        "where the model's threads already use every core: `tokenmill bench features --only overlap`)",
        action=argparse.BooleanOptionalAction,
    )
    speculative_method: str | None = option(
        None,
        "speculative decoding: propose up to --num-speculative-tokens tokens per decoding sequence and "
        "verify them all in one forward pass of the model (greedy output unchanged, sampled output from the same "
        "distribution); ngram = what followed the sequence's last n tokens where they occurred earlier in its "
        "prompt or output (no extra model), draft = a small model with the same tokenizer "
        "(--speculative-model). Turns overlap scheduling off (default: off)",
        choices=["ngram", "draft"],
    )
    num_speculative_tokens: int = option(
        4, "most tokens proposed per sequence and step with --speculative-method (default: 4)", metavar="K"
    )
    speculative_model: str | None = option(
        None,
        "--speculative-method draft: the draft model, as --model takes one (a hub repository id, a local "
        "directory or a .gguf file; same vocabulary and tokenizer as --model)",
        metavar="MODEL",
    )
    ngram_prompt_lookup_min: int = option(
        2, "--speculative-method ngram: shortest n-gram to look up (default: 2)", metavar="N"
    )
    ngram_prompt_lookup_max: int = option(
        4,
        "--speculative-method ngram: longest n-gram to look up; longer matches are tried first (default: 4)",
        metavar="N",
    )
    seed: int = option(0, "engine seed for unseeded sampling")
    tensor_parallel_size: int = option(
        1,
        "split attention heads and MLP columns over N processes on this machine (gloo on CPU, NCCL with "
        "one GPU each on CUDA); Llama family (default: 1)",
        aliases=["-tp"],
        metavar="N",
    )
    num_threads: int | None = option(None, "torch CPU threads (default: all cores)", type=int)
    # Multi-LoRA (tokenmill.lora): adapters are selected per request by name (the API's `model`).
    enable_lora: bool = option(
        False,
        "serve LoRA adapters of the base model (implied by --lora-modules): a batch mixes requests of "
        "different adapters and of the base model; native Llama-family models",
    )
    lora_modules: list[str] | None = option(
        None,
        "LoRA adapters to load at start, each NAME=PATH (a PEFT directory or a hub repository id) or vLLM's JSON "
        'form \'{"name": ..., "path": ..., "base_model_name": ...}\'; a request selects one with model=NAME',
        nargs="+",
        type=str,
        metavar="NAME=PATH",
    )
    max_loras: int = option(
        1,
        "LoRA adapters resident at once (compute-side slots); others wait in CPU memory and are swapped "
        "in least-recently-used first; a step mixes at most this many adapters",
        metavar="N",
    )
    max_lora_rank: int = option(16, "largest LoRA rank an adapter may have (slots are sized for it)", metavar="R")
    max_cpu_loras: int = option(
        64,
        "LoRA adapters loaded at most (held in CPU memory: --lora-modules and run-time loads count); one "
        "more is refused until another is unloaded",
        metavar="N",
    )

    @property
    def served_model_names(self) -> list[str]:
        """--served-model-name as a list (the offline API also takes one name as a string)."""
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [])

    def hub_options(self) -> HubOptions:
        """How --model's repository id is fetched."""
        return HubOptions(self.revision, self.download_dir, self.hf_token)

    def tokenizer_hub_options(self) -> HubOptions:
        return HubOptions(self.tokenizer_revision, self.download_dir, self.hf_token)

    def check_sources(self) -> None:
        """Refuse model-source settings tokenmill cannot honour (before anything is fetched)."""
        if self.trust_remote_code:
            raise ValueError(
                "--trust-remote-code: tokenmill never runs code from a model repository; it serves the "
                "architectures it implements (`tokenmill models`) from their weights, without the flag"
            )
        if self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be >= 0 (or -1: no limit), got {self.max_logprobs}")

    def batch_invariance_blockers(self) -> list[str]:
        """The settings under which --batch-invariant cannot hold: tensor parallelism (an all-reduce
        sums each value in an order set by the step's size), --compile (inductor's own kernels), LoRA
        (a step's adapter deltas on GEMMs shaped by the step)."""
        blockers = {
            "--tensor-parallel-size > 1": self.tensor_parallel_size > 1,
            "--compile": self.compile,
            "LoRA adapters": self.lora_enabled,
        }
        return [name for name, blocks in blockers.items() if blocks]

    def check_batch_invariance(self) -> None:
        """Refuse --batch-invariant where it cannot hold (before anything is loaded)."""
        if self.batch_invariant and (named := self.batch_invariance_blockers()):
            raise ValueError(f"--batch-invariant cannot hold with {' or '.join(named)}; leave it off there")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def check_lora(self) -> None:
        """Refuse LoRA settings that cannot work (before anything is loaded)."""
        if not self.lora_enabled:
            return
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < 1:
            raise ValueError(f"--max-cpu-loras must be >= 1, got {self.max_cpu_loras}")
        if self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with --tensor-parallel-size > 1 yet")
        if self.compile:
            raise ValueError("LoRA adapters are not supported with --compile yet")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, **overrides: dict[str, Any]) -> None:
        """The engine flags, in their own help group; `overrides` as in `add_options`."""
        add_options(parser.add_argument_group("engine"), EngineConfig, overrides=overrides)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return from_args(cls, args)


def parse_memory(text: str) -> int:
    """'512MiB' / '2GiB' / '1.5GB' / '1000000' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for suffix, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))
