"""vLLM `serve` flags without a tokenmill flag of the same name: each is either what tokenmill
always does (accepted, so a vLLM command line runs unchanged) or refused with a message naming it
and what to use instead, never silently ignored. docs/model-sources.md has the whole mapping."""

from __future__ import annotations

import argparse
from typing import Any

# Switches whose meaning tokenmill always provides: accepted.
ALWAYS_SO = {
    "--enable-chunked-prefill": "prefills are always chunked to --max-num-batched-tokens",
    "--disable-log-stats": "tokenmill logs no periodic stats (they are on /metrics)",
    "--enforce-eager": "no CUDA graphs unless --cuda-graphs (and no torch.compile unless --compile)",
}

# Flags tokenmill cannot honour, with what to use instead.
REFUSED = {
    "--gpu-memory-utilization": "tokenmill sizes its KV cache with --kv-cache-memory (e.g. 4GiB) or "
    "--kv-cache-memory-fraction (a fraction of free memory)",
    "--pipeline-parallel-size": "pipeline parallelism is not implemented; use --tensor-parallel-size",
    "--data-parallel-size": "run one server per replica (tokenmill serve-ray scales replicas)",
    "--swap-space": "tokenmill recomputes preempted requests instead of swapping KV blocks to CPU memory",
    "--cpu-offload-gb": "tokenmill does not offload weights",
    "--load-format": "tokenmill reads what --model names: safetensors, pytorch_model*.bin or a .gguf file",
    "--tokenizer-mode": "tokenmill always uses the tokenizer's fast (tokenizers) backend",
    "--code-revision": "tokenmill never runs code from a model repository",
    "--config": "pass the flags themselves (no YAML config file)",
    "--speculative-config": "use --speculative-method ngram|draft, --speculative-model and --num-speculative-tokens",
    "--limit-mm-per-prompt": "tokenmill serves text-only models",
    "--max-seq-len-to-capture": "use --cuda-graphs (graphs are captured per bucket on first use)",
    "--override-generation-config": "use --generation-config DIR (a directory with a generation_config.json)",
    "--kv-transfer-config": "disaggregated prefill is not implemented",
    "--distributed-executor-backend": "tensor-parallel workers are processes on this machine (--tensor-parallel-size)",
}
SHORT_ALIASES = {"-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size"}


class _Refuse(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        flag = SHORT_ALIASES.get(option or "", option or self.option_strings[0])
        parser.error(f"{option}: a vLLM flag tokenmill does not support: {REFUSED[flag]}")


class _AlwaysSo(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        namespace.vllm_always_so = [*(getattr(namespace, "vllm_always_so", None) or []), option]


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The flags above, in a group of their own (docs/model-sources.md maps every vLLM flag)."""
    group = parser.add_argument_group(
        "vLLM flags without a tokenmill equivalent", "accepted where tokenmill always does what they ask, else refused"
    )
    aliases = {flag: [short for short, long in SHORT_ALIASES.items() if long == flag] for flag in REFUSED}
    for flag, instead in REFUSED.items():
        group.add_argument(flag, *aliases[flag], nargs="?", action=_Refuse, metavar="VALUE", help=f"refused: {instead}")
    for flag, meaning in ALWAYS_SO.items():
        group.add_argument(flag, nargs=0, action=_AlwaysSo, dest="vllm_always_so", help=f"accepted: {meaning}")


def check_always_so(args: argparse.Namespace) -> None:
    """--enforce-eager with --cuda-graphs or --compile contradicts itself."""
    given = getattr(args, "vllm_always_so", None) or []
    if "--enforce-eager" in given and (getattr(args, "cuda_graphs", False) or getattr(args, "compile", False)):
        raise ValueError("--enforce-eager contradicts --cuda-graphs / --compile")
