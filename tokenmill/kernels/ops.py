"""Python entry points of tokenmill's C++ CPU kernels (see `build.py`)."""

from __future__ import annotations

import torch

from tokenmill.kernels.build import load


def cpu_kernels_available(device: torch.device) -> bool:
    """Whether steps on `device` should attend with the fused CPU kernel (built and loaded here)."""
    return device.type == "cpu" and load()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Attention of each sequence's queries over its paged K/V, written into `out` (rows of q)."""
    if not load():  # a worker process that did not decide to use the kernel itself: fail loudly
        raise RuntimeError("tokenmill's CPU kernels are not available in this process")
    torch.ops.tokenmill.paged_attention(
        q,
        k_cache,
        v_cache,
        out,
        query_start,
        query_lens,
        block_tables,
        context_lens,
        block_size,
        scale,
        window or 0,
        softcap or 0.0,
    )


def fused_elementwise(x: torch.Tensor) -> bool:
    """Whether per-op work on `x` should run as tokenmill's CPU kernels (fused RMSNorm, SiLU*up, RoPE):
    fp32 or bf16 on CPU with the kernels built, and not while torch.compile traces (it fuses itself,
    and the ops have no fake implementations)."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and not torch.compiler.is_compiling() and load()
