"""Memory-bandwidth roofline for batch-1 decode (`tokenmill bench offline --roofline`).

At batch 1 a decode step has to stream every weight matrix from memory once (the lm_head reads the
whole embedding matrix when it is tied), and does little arithmetic per byte, so the step cannot be
faster than `weight_bytes / copy_bandwidth`. This module measures both sides on this machine: the
bandwidth of a large tensor copy (read + write bytes), the bytes a step streams, and the engine's
real batch-1 time per output token, and reports how far the engine is from the bound. The bound is
DRAM's: a model whose weights fit largely in the last-level cache (a tiny test model on a CPU with
a large L3) can step faster than it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.models.layers.linear import Linear

GIB = 1 << 30


@dataclass
class RooflineResult:
    copy_bytes: int  # size of the copied tensor (bytes read; the same again is written)
    copy_reps: int
    bandwidth_gbs: float  # best-of-reps (read + write bytes) / time, in 1e9 bytes/s
    param_bytes: int  # every parameter once (tied embeddings once)
    weight_bytes: int  # bytes one decode step streams: param_bytes minus untied embedding tables
    bound_step_s: float  # weight_bytes / bandwidth
    bound_steps_per_s: float
    prompt_len: int
    new_tokens: int
    measured_step_s: float  # best run: (finished - first token) / (new_tokens - 1)
    measured_steps_per_s: float
    ratio: float  # measured_step_s / bound_step_s (1.0 = at the bandwidth bound)
    device: str
    dtype: str
    num_threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(num_bytes: int = GIB, reps: int = 5, device: str | torch.device = "cpu") -> float:
    """Best-of-`reps` copy bandwidth of an fp32 tensor of `num_bytes`, counting read + write, in GB/s."""
    device = torch.device(device)
    numel = max(1, num_bytes // 4)
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and allocation are not bandwidth
    _sync(device)
    best = float("inf")
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * numel * 4 / best / 1e9


def model_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(all parameter bytes, bytes streamed per decode step) of `model`.

    Tensors shared between modules (tied embedding / lm_head) count once. Parameters and non-rope
    buffers count (weight-only quantization may keep int8 weights and scales as buffers). Embedding
    tables that no Linear layer shares are left out of the streamed bytes: a step reads only one row
    of them per token. A tied embedding is read in full by the lm_head, so it stays in, once.
    Of a mixture-of-experts layer's experts, a batch-1 step reads only the top-k it routes to.
    """
    seen: dict[int, int] = {}
    linear_ptrs: set[int] = set()
    embedding_ptrs: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (nn.Linear, Linear)) and isinstance(weight, torch.Tensor):
            linear_ptrs.add(weight.data_ptr())
        elif isinstance(module, nn.Embedding):
            embedding_ptrs.add(module.weight.data_ptr())
    tensors: list[torch.Tensor] = list(model.parameters())
    tensors += [b for name, b in model.named_buffers() if "rope" not in name and "inv_freq" not in name]
    for t in tensors:
        if t.numel() == 0:
            continue
        seen.setdefault(t.data_ptr(), t.numel() * t.element_size())
    # Weights that are neither parameters nor buffers: what linear layers' methods packed (oneDNN's
    # opaque tensors too), all streamed every step.
    opaque = 0
    for module in model.modules():
        if isinstance(module, Linear):
            opaque += sum(t.numel() * t.element_size() for t in module.quant_method.streamed_tensors(module))
    total = sum(seen.values())
    untied = sum(seen.get(ptr, 0) for ptr in embedding_ptrs - linear_ptrs)
    return total + opaque, total - untied + opaque - _unrouted_expert_bytes(model)


def _unrouted_expert_bytes(model: nn.Module) -> int:
    """Bytes of the experts a batch-1 step does not route to (E - k of every MoE layer's E)."""
    from tokenmill.models.layers.moe import SparseMoE

    unread = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            config = module.gate.config
            unread += model_weight_bytes(module.experts)[0] * (config.num_experts - config.top_k) // config.num_experts
    return unread


def measure_decode_step(
    llm: Any, prompt_len: int = 32, new_tokens: int = 128, reps: int = 2, warmup_tokens: int = 8
) -> float:
    """Best-of-`reps` batch-1 decode time per output token after the first, in seconds."""
    from tokenmill import SamplingParams

    if new_tokens < 2:
        raise ValueError("need at least 2 new tokens to time decode steps")
    vocab = llm.engine.spec.vocab_size
    prompt = [(100 + 7919 * i) % max(vocab - 100, 1) + 100 if vocab > 200 else i % vocab for i in range(prompt_len)]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=warmup_tokens, ignore_eos=True))
    best = float("inf")
    for _ in range(max(1, reps)):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        if m.first_token_time is None or m.finished_time is None or n < 2:
            raise RuntimeError("the engine did not report first-token/finish times")
        best = min(best, (m.finished_time - m.first_token_time) / (n - 1))
    return best


def measure_roofline(
    llm: Any,
    prompt_len: int = 32,
    new_tokens: int = 128,
    copy_bytes: int = GIB,
    copy_reps: int = 5,
    decode_reps: int = 2,
) -> RooflineResult:
    """Copy bandwidth, streamed weight bytes, the bound they imply, and the measured batch-1 step."""
    engine = llm.engine
    device = torch.device(getattr(engine, "device", "cpu"))
    bandwidth = copy_bandwidth(copy_bytes, copy_reps, device)
    param_bytes, weight_bytes = model_weight_bytes(engine.model)
    bound = weight_bytes / (bandwidth * 1e9)
    measured = measure_decode_step(llm, prompt_len, new_tokens, decode_reps)
    return RooflineResult(
        copy_bytes=copy_bytes,
        copy_reps=copy_reps,
        bandwidth_gbs=bandwidth,
        param_bytes=param_bytes,
        weight_bytes=weight_bytes,
        bound_step_s=bound,
        bound_steps_per_s=1.0 / bound if bound > 0 else float("inf"),
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        measured_step_s=measured,
        measured_steps_per_s=1.0 / measured if measured > 0 else float("inf"),
        ratio=measured / bound if bound > 0 else float("inf"),
        device=str(device),
        dtype=str(getattr(engine, "dtype", "")).replace("torch.", ""),
        num_threads=torch.get_num_threads(),
    )


def format_roofline(r: RooflineResult) -> str:
    rows = [
        ("Copy bandwidth (GB/s, read+write)", f"{r.bandwidth_gbs:.2f}"),
        ("Parameter bytes (MB)", f"{r.param_bytes / 1e6:.1f}"),
        ("Weight bytes streamed per step (MB)", f"{r.weight_bytes / 1e6:.1f}"),
        ("Bound step time (ms)", f"{r.bound_step_s * 1e3:.2f}"),
        ("Bound steps/s", f"{r.bound_steps_per_s:.1f}"),
        (f"Measured bs1 step (ms, prompt {r.prompt_len}, {r.new_tokens} new)", f"{r.measured_step_s * 1e3:.2f}"),
        ("Measured steps/s (tok/s)", f"{r.measured_steps_per_s:.1f}"),
        ("Ratio measured / bound", f"{r.ratio:.2f}x"),
    ]
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    rule = "-" * (width + vwidth + 2)
    return "\n".join(
        [rule, "Roofline (batch-1 decode)", rule, *(f"{k.ljust(width)}  {v.rjust(vwidth)}" for k, v in rows), rule]
    )
