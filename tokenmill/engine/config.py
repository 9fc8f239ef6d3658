"""Engine settings: one dataclass shared by the CLI, the server and the offline API."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass
class EngineConfig:
    model: str | None = None  # local HF directory; None = the bundled default model
    served_model_name: str | None = None  # name reported by /v1/models (default: directory name)
    model_impl: str = "auto"  # auto | native | transformers (the generic path over HF's modeling code)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: fp32 on CPU, bf16/fp16 on GPU)
    device: str = "auto"  # auto | cpu | cuda
    quantization: str | None = None  # None | "int8" (weight-only, per output channel)
    block_size: int = 16
    kv_cache_memory: str | None = None  # e.g. "2GiB"; default: a fraction of free memory
    kv_cache_memory_fraction: float = 0.3  # of free memory, used when kv_cache_memory is unset
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    result_cache_size: int = 0  # finished deterministic completions kept for identical requests; 0 = off
    compile: bool = False
    cuda_graphs: bool = False  # GPU: replay decode steps as CUDA graphs (bucketed batch and context sizes)
    # Schedule/prepare step N+1 and detokenize step N while the model runs step N on its own thread.
    # None = auto: on with CUDA; off on CPU, where the model's threads already use every core.
    overlap_scheduling: bool | None = None
    onednn_linear: bool = True  # CPU: linear layers on oneDNN with pre-packed weights
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks (processes) the layers are split over, on one machine
    num_threads: int | None = None  # torch intra-op threads on CPU (default: all cores)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="local Hugging Face model directory (default: bundled SmolLM2-135M-Instruct)")
        g.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"], help="model code: native = tokenmill's own fast paths (listed by `tokenmill models`), transformers = the generic path running HF's modeling code with tokenmill's paged attention, auto = native when the architecture has one, else transformers")
        g.add_argument("--served-model-name", default=None, help="model name reported by the API (default: the directory name)")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="weight/activation dtype; auto = fp32 on CPU, bf16 (or fp16) on GPU")
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run; auto picks CUDA when available")
        g.add_argument("--quantization", default=None, choices=["int8"], help="weight-only quantization of the linear layers")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
        g.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB or 2GiB (default: --kv-cache-memory-fraction of free memory)")
        g.add_argument("--kv-cache-memory-fraction", type=float, default=0.3, help="fraction of free device memory for the KV cache when --kv-cache-memory is unset")
        g.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one batch")
        g.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget per step (prefill chunks + decodes)")
        g.add_argument("--max-model-len", type=int, default=None, help="context length limit (default: the model's)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse KV blocks of shared prompt prefixes")
        g.add_argument("--result-cache-size", type=int, default=0, metavar="N",
                       help="answer repeats of identical greedy or seeded requests from an LRU of the last N "
                            "finished completions, without running the model (default: 0 = off)")
        g.add_argument("--onednn-linear", action=argparse.BooleanOptionalAction, default=True,
                       help="CPU only: run the linear layers on oneDNN with weights pre-packed at load "
                            "(fp32/bf16; measured 2.5x the default MKL GEMMs on AMD CPUs). Ignored with "
                            "--quantization, --compile and on GPU")
        g.add_argument("--compile", action="store_true",
                       help="torch.compile the dense parts of the model step (dynamic token count; attention "
                            "stays eager)")
        g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                       help="GPU only: replay decode-only steps as CUDA graphs, one per (batch size, context "
                            "length) bucket, captured on first use; other steps run eagerly. Ignored on CPU "
                            "and with --tensor-parallel-size > 1")
        g.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="run the model on its own thread, one step ahead: step N+1 is scheduled and "
                            "prepared, and step N's tokens detokenized and streamed, while the model runs "
                            "step N (default: on with CUDA; off on CPU, where the model's threads already "
                            "use every core and sharing them measured 0.7x)")
        g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="split attention heads and MLP columns over N processes on this machine "
                            "(gloo on CPU, NCCL with one GPU each on CUDA); Llama family (default: 1)")
        g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def parse_memory(text: str) -> int:
    """'512MiB' / '2GiB' / '1.5GB' / '1000000' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for suffix, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))
