"""The one Python entry point of tokenmill's C++ CPU kernels (built and loaded by `build.py`, every op
registered in csrc/cpu/bindings.cpp).

Each op is called through a function here, which loads the kernels on first use (and fails loudly in
a process where they cannot be: callers decide with `cpu_kernels_available` first). The ops' fake
(meta) implementations are registered with the library, so that torch.compile and other tracers see
their output shapes without running them.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.kernels.build import load


def cpu_kernels_available(device: torch.device) -> bool:
    """Whether steps on `device` should run tokenmill's CPU kernels (built and loaded here)."""
    return device.type == "cpu" and load()


def fused_elementwise(x: torch.Tensor) -> bool:
    """Whether per-op work on `x` should run as tokenmill's CPU kernels (fused RMSNorm, SiLU*up, RoPE):
    fp32 or bf16 on CPU with the kernels built, and not while torch.compile traces (it fuses those
    itself)."""
    return x.dtype in (torch.float32, torch.bfloat16) and x.is_cpu and not torch.compiler.is_compiling() and load()


_LIBRARY: Any = None  # torch.ops.tokenmill once loaded (a plain global: torch.compile reads it, no call)


def _library() -> Any:
    global _LIBRARY
    if _LIBRARY is None:
        if not load():  # a process that did not decide to use the kernels itself: fail loudly
            raise RuntimeError("tokenmill's CPU kernels are not available in this process")
        _register_fakes()
        _LIBRARY = torch.ops.tokenmill
    return _LIBRARY


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
    _library().paged_attention(
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


# -- elementwise (elementwise.cpp) ------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _library().rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [rows, 2 * inter]."""
    return _library().silu_mul(gate_up)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, heads, dim] and k [T, kv_heads, dim] rotated in place by cos/sin [T, rotary]."""
    _library().rope_(q, k, cos, sin)


# -- linear layers (panel_linear, bf16_pair_linear, int8_linear, onednn_linear, amx_linear .cpp) -------


def linear_panel_width() -> int:
    """Output columns per panel of a packed weight (16 on AVX2, 32 on AVX-512)."""
    return int(_library().linear_panel_width())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32/bf16 weight [N, K] (or int8 scales [N, groups]) as panels [panels, K, width]."""
    return _library().pack_linear_weight(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return _library().packed_linear(x, packed, bias, n)


def packed_logits(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """packed_linear's fp32 sums, not rounded to x's dtype."""
    return _library().packed_logits(x, packed, bias, n)


def bf16_pair_linear_supported() -> bool:
    """Whether bf16_pair_linear runs here (AVX512-BF16, and the kernels built for AVX-512)."""
    return bool(_library().bf16_pair_linear_supported())


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] as bf16 panels by pairs of inputs [panels, ceil(K / 2), 2 * width]."""
    return _library().pack_bf16_pairs(weight)


def bf16_pair_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """bf16 x W^T (+ bias) on AVX512-BF16 dot products over pair panels, rounded to bf16."""
    return _library().bf16_pair_linear(x, packed, bias, n)


def bf16_pair_logits(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """bf16_pair_linear's fp32 sums, not rounded."""
    return _library().bf16_pair_logits(x, packed, bias, n)


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """An int8 weight [N, K] as panels by pairs of inputs [panels, K / 2, 2 * width]."""
    return _library().pack_int8_weight(weight)


def packed_int8_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    return _library().packed_int8_linear(x, packed, scales, bias, n)


def packed_int8_logits(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    return _library().packed_int8_logits(x, packed, scales, bias, n)


def packed_int8_rows(
    ids: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of an int8 matrix packed by pack_int8_weight, times their scales, as `dtype`."""
    return _library().packed_int8_rows(ids, packed, scales, k, dtype)


def packed_int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    zero: int,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """x W^T (+ bias) over 4-bit panels (see csrc/cpu/int4_linear.cpp for the layout)."""
    return _library().packed_int4_linear(x, packed, scales, zeros, zero, offsets, bias, n)


def packed_int4_logits(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    zero: int,
    offsets: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    return _library().packed_int4_logits(x, packed, scales, zeros, zero, offsets, bias, n)


def fp8_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x (W * S)^T (+ bias) for e4m3 weight bytes in panels, widened and scaled as they stream (see
    csrc/cpu/fp8_linear.cpp)."""
    return _library().fp8_linear(x, packed, scales, group_size, bias, n)


def w8a8_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    offsets: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """x W^T (+ bias) for int8 weights in quad panels (per-column scales and offsets) and x rounded to
    int8 per row by its own scale (see csrc/cpu/w8a8_linear.cpp)."""
    return _library().w8a8_linear(x, packed, offsets, scales, bias, n)


def w8a8_instructions(rows: int) -> str:
    """What a W8A8 step of `rows` rows runs on here: amx-int8, avx512-vnni, avx-vnni, pmaddwd (no int8
    dot products on this CPU) or scalar (kernels built without vector extensions)."""
    return str(_library().w8a8_instructions(rows))


def int8_group_scales(groups: torch.Tensor, candidates: int) -> torch.Tensor:
    return _library().int8_group_scales(groups, candidates)


def int4_affine_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(levels [G, size] uint8, scales [G] fp16, offsets [G] fp16) of fp32 groups [G, size]: each
    group's least-error affine 4-bit grid (see csrc/cpu/quantize.cpp)."""
    return _library().int4_affine_groups(groups)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _library().onednn_linear(x, packed, bias)


def amx_linear_applies(x: torch.Tensor, packed: torch.Tensor) -> bool:
    return bool(_library().amx_linear_applies(x, packed))


def amx_logits(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _library().amx_logits(x, packed, bias)


# -- LoRA (lora.cpp), sampling (sampling.cpp), decoder layers (decoder_layer.cpp) ----------------------


def lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    rows: torch.Tensor,
    segments: torch.Tensor,
    blocks: torch.Tensor,
) -> None:
    """Adds each row group's LoRA delta to `out` in place."""
    _library().lora_delta(x, out, lora_a, lora_b, rows, segments, blocks)


def sample_tokens(
    logits: torch.Tensor,
    greedy: list[bool],
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    uniform: list[float],
) -> torch.Tensor:
    return _library().sample_tokens(logits, greedy, temperature, top_k, top_p, min_p, uniform)


def llama_decoder_layer(*args: Any) -> torch.Tensor:
    """One Llama-shaped decoder layer (the arguments: see csrc/cpu/bindings.cpp)."""
    return _library().llama_decoder_layer(*args)


def decoder_stack(
    tensors: list[torch.Tensor | None],
    ints: list[int],
    floats: list[float],
    final_norm: torch.Tensor,
    final_eps: float,
) -> Any:
    """A DecoderStack holding every layer's weights (see csrc/cpu/decoder_layer.cpp)."""
    _library()
    return torch.classes.tokenmill.DecoderStack(tensors, ints, floats, final_norm, final_eps)


# -- fake implementations ---------------------------------------------------------------------------


def _rows(x: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n), dtype=dtype or x.dtype)


def _register_fakes() -> None:
    fake = torch.library.register_fake
    width = int(torch.ops.tokenmill.linear_panel_width())
    fake("tokenmill::paged_attention")(lambda *args: None)
    fake("tokenmill::rms_norm")(lambda x, weight, eps: torch.empty_like(x))
    fake("tokenmill::silu_mul")(lambda gate_up: _rows(gate_up, gate_up.shape[-1] // 2))
    fake("tokenmill::rope_")(lambda q, k, cos, sin: None)
    fake("tokenmill::pack_linear_weight")(lambda w: w.new_empty((-(-w.shape[0] // width), w.shape[1], width)))
    fake("tokenmill::packed_linear")(lambda x, packed, bias, n: _rows(x, n))
    fake("tokenmill::packed_logits")(lambda x, packed, bias, n: _rows(x, n, torch.float32))
    fake("tokenmill::pack_bf16_pairs")(
        lambda w: w.new_empty((-(-w.shape[0] // width), (w.shape[1] + 1) // 2, 2 * width), dtype=torch.bfloat16)
    )
    fake("tokenmill::bf16_pair_linear")(lambda x, packed, bias, n: _rows(x, n))
    fake("tokenmill::bf16_pair_logits")(lambda x, packed, bias, n: _rows(x, n, torch.float32))
    fake("tokenmill::pack_int8_weight")(
        lambda w: w.new_empty((-(-w.shape[0] // width), (w.shape[1] + 1) // 2, 2 * width))
    )
    fake("tokenmill::packed_int8_linear")(lambda x, packed, scales, bias, n: _rows(x, n))
    fake("tokenmill::packed_int8_logits")(lambda x, packed, scales, bias, n: _rows(x, n, torch.float32))
    fake("tokenmill::packed_int4_linear")(lambda x, packed, scales, zeros, zero, offsets, bias, n: _rows(x, n))
    fake("tokenmill::packed_int4_logits")(
        lambda x, packed, scales, zeros, zero, offsets, bias, n: _rows(x, n, torch.float32)
    )
    fake("tokenmill::packed_int8_rows")(
        lambda ids, packed, scales, k, dtype: packed.new_empty((*ids.shape, k), dtype=dtype)
    )
    fake("tokenmill::fp8_linear")(lambda x, packed, scales, group_size, bias, n: _rows(x, n))
    fake("tokenmill::w8a8_linear")(lambda x, packed, offsets, scales, bias, n: _rows(x, n))
    fake("tokenmill::int8_group_scales")(lambda groups, c: groups.new_empty(groups.shape[0], dtype=torch.bfloat16))
    fake("tokenmill::int4_affine_groups")(
        lambda groups: (
            groups.new_empty(groups.shape, dtype=torch.uint8),
            groups.new_empty(groups.shape[0], dtype=torch.float16),
            groups.new_empty(groups.shape[0], dtype=torch.float16),
        )
    )
    fake("tokenmill::onednn_linear")(lambda x, packed, bias: _rows(x, packed.shape[0]))
    fake("tokenmill::amx_linear")(lambda x, packed, bias: _rows(x, packed.shape[0]))
    fake("tokenmill::amx_logits")(lambda x, packed, bias: _rows(x, packed.shape[0], torch.float32))
    fake("tokenmill::lora_delta")(lambda *args: None)
    fake("tokenmill::sample_tokens")(lambda logits, *settings: logits.new_empty(logits.shape[0], dtype=torch.long))
    fake("tokenmill::llama_decoder_layer")(lambda x, *args: torch.empty_like(x))
