"""Methods of float linear layers with their weights packed once at load, for CPU inference
(`--packed-linear`; see linear.py for methods).

PyTorch runs a CPU `nn.Linear` through MKL's sgemm, which on AMD CPUs takes a slow code path
(below oneDNN's rate on decode-batch shapes: `tokenmill bench kernels`).
Three packings replace it, chosen by the weight's dtype, the CPU and batch invariance:

- fp32 (`PanelLinearMethod`): tokenmill's panel GEMM (kernels/csrc/cpu/panel_linear.cpp): the weight in
  panels of 16 (AVX2) or 32 (AVX-512) output columns, k-major, which one row streams at memory
  speed and many rows multiply from registers: faster than oneDNN's packed fp32 weights, most at
  few rows (`tokenmill bench kernels` on the model's layer shapes).
- bf16 on a CPU without native bf16 (AMX or AVX512-BF16) goes to the same panel GEMM, each weight
  widened to fp32 as it streams (half the bytes of fp32, fp32 arithmetic); so does bf16 under batch
  invariance on Intel CPUs with AVX512-BF16 but no AMX, where these FMAs outran oneDNN's bf16 GEMMs.
- fp32 weights whose every value is a bf16 value (a model published in bf16, run in fp32: SmolLM2)
  are held in bf16 panels too: the kernel widens them back exactly, so the results are the fp32
  panels' bit for bit, from half the bytes (batch-1 decode streams the weights once per step).
- bf16 under batch invariance on AMD CPUs with AVX512-BF16 (Zen 4/5, whose bf16 dot products issue
  at the FMAs' rate; `PairPanelLinearMethod`): the weight in panels by pairs of inputs, bf16
  activations multiplied by AVX512-BF16 dot products (kernels/csrc/cpu/bf16_pair_linear.cpp), fp32
  sums. (oneDNN's bf16 GEMMs on CPUs without AMX block the inputs by the row count, so a row's bits
  depended on how many rows shared its step: docs/batch-invariance.md.)
- bf16 on CPUs with native bf16, or fp32 where tokenmill's kernels cannot be built (`OneDnnLinearMethod`):
  oneDNN with the weight reordered into its blocked layout (AMX / AVX512-BF16). On AMX CPUs, steps
  of up to 64 rows (decode) read that same weight with tokenmill's AMX tiles instead
  (kernels/csrc/cpu/amx_linear.cpp: up to 32 rows bit-identical to oneDNN's results, faster;
  33-64 rows as chunks of 32, each row's bits those it has in any step, close to oneDNN's own
  blocking of those rows: `python bench/amx_linear_vs_onednn.py`).

Either way the math stays in the weight's dtype with fp32 accumulation; only the blocking and the
order of the sums differ, like any other BLAS. The panel and pair packings compute each output as one
chain over the inputs in order, whatever the step's row count: a row's result does not depend on the
other rows of its step. MoE expert weights are not linear layers and
stay stacked on `grouped_mm` (see moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import build, ops
from tokenmill.kernels.cpu_caps import detect
from tokenmill.models.layers.linear import FusedProjection, Linear, LinearMethod, stored

# oneDNN's reorder takes a typical row count; 64 (a decode batch) was as fast as a matching hint for
# 8 to 1024 rows, while a hint of 1 slowed batches down.
_BATCH_HINT = 64


def padded_rows(rows: int) -> int:
    """Row counts rounded up to buckets. oneDNN builds (JIT-compiles) a primitive for every new input
    shape (milliseconds for each layer GEMM's); a step's token count takes hundreds of values,
    and building a primitive per step per layer type cost more than the padding does (<= 1/8 extra
    rows at worst, under 1/16 past 512 rows: 78 buckets up to 4,096 rows, within oneDNN's primitive
    cache for a model's few weight shapes). Buckets of 128 past 256 rows had a serving step of 63
    decodes and a 256-token prefill pay for 384 rows. (The C++ projection,
    kernels/csrc/cpu/onednn_linear.cpp, pads to the same buckets; a test holds them equal.)"""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 32 if rows <= 512 else 64
    return -(-rows // step) * step


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PanelLinearMethod(LinearMethod):
    """fp32 (or bf16 where the CPU has no native bf16: widened to fp32 as the weight streams, half
    the bytes), on tokenmill's panel GEMM: any row count, and a row's result does not depend on the
    other rows of its step. The packed weight (`layer.packed_weight`) is held in panel_dtype."""

    name = "panels"

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        width = ops.linear_panel_width()
        return [(-(-layer.out_features // width) * width * layer.in_features, panel_dtype(layer.weight))]

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = layer.weight.detach()
        dtype = storage[0].dtype if storage else panel_dtype(weight)
        layer.packed_weight = stored(storage, 0, ops.pack_linear_weight(weight.to(dtype)))
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_linear(x, layer.packed_weight, layer.bias, layer.out_features)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_logits(x, layer.packed_weight, layer.bias, layer.out_features)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        packed = layer.packed_weight  # [panels, K, width]
        return packed.transpose(1, 2).reshape(-1, packed.shape[1])[: layer.out_features].to(dtype)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        # (bf16 activations on bf16 panels: widened to fp32, as packed_linear widens them)
        bf16_panels = activations == torch.bfloat16 and layer.packed_weight.dtype == torch.bfloat16
        if activations == torch.float32 or bf16_panels:
            return FusedProjection(layer.packed_weight, None, layer.bias)
        return None

    def tied_embedding(self, layer: Linear, embedding: nn.Embedding) -> nn.Module | None:
        return PanelEmbedding(embedding, layer)

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.packed_weight]

    def describe(self, layer: Linear) -> str:
        held = getattr(layer, "packed_weight", None)
        return self.name if held is None else f"{self.name} ({str(held.dtype).removeprefix('torch.')})"


class PairPanelLinearMethod(LinearMethod):
    """bf16 on AVX512-BF16 dot products (kernels/csrc/cpu/bf16_pair_linear.cpp): the weight in
    panels by pairs of inputs (`layer.packed_weight`), bf16 activations, fp32 sums; any row count,
    and a row's result does not depend on the other rows of its step."""

    name = "pair panels"

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        width = ops.linear_panel_width()
        pairs = -(-layer.in_features // 2)
        return [(-(-layer.out_features // width) * width * 2 * pairs, torch.bfloat16)]

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        layer.packed_weight = stored(storage, 0, ops.pack_bf16_pairs(layer.weight.detach()))
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.bf16_pair_linear(x, layer.packed_weight, layer.bias, layer.out_features)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return ops.bf16_pair_logits(x, layer.packed_weight, layer.bias, layer.out_features)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        packed = layer.packed_weight  # [panels, K / 2, 2 * width]: [p, j, 2c + t] = W[p * width + c, 2j + t]
        panels, pairs, width = packed.shape[0], packed.shape[1], packed.shape[2] // 2
        weight = packed.view(panels, pairs, width, 2).permute(0, 2, 1, 3).reshape(panels * width, 2 * pairs)
        return weight[: layer.out_features, : layer.in_features].to(dtype)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        if activations == torch.bfloat16 and layer.in_features % 2 == 0:
            return FusedProjection(layer.packed_weight, None, layer.bias)
        return None

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.packed_weight]


class PanelEmbedding(nn.Module):
    """The token embedding of a model whose lm_head shares (ties) its matrix, read from the head's
    panel-packed copy: row v of the matrix is column v % width of panel v // width. One copy of the
    vocabulary matrix instead of two (SmolLM2: 113 MB at fp32); a lookup reads one strided row per
    token, nothing next to the head's full pass over the matrix every step."""

    def __init__(self, embedding: nn.Embedding, head: Linear) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.panels = head.packed_weight  # [panels, dim, width] (not `packed_weight`: counted once, at the head)
        self.width = self.panels.shape[-1]
        self.dtype = embedding.weight.dtype  # of the rows returned (the panels may be held narrower)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.panels[flat // self.width, :, flat % self.width].view(*ids.shape, self.embedding_dim)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from the packed lm_head"


class OneDnnLinearMethod(LinearMethod):
    """fp32 or bf16, W held as an opaque oneDNN tensor (`layer.packed_weight`). With tokenmill's
    kernels built, a call is the C++ op that the fused decoder layers call too (the same padding, the
    same result)."""

    name = "onednn"

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        weight = layer.weight.detach()
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        del layer.weight
        layer.native = build.load()
        layer.amx_decode = False
        if layer.native and weight.dtype == torch.bfloat16:
            # Decode-sized steps on AMX CPUs read this weight with tokenmill's AMX tiles
            # (kernels/csrc/cpu/amx_linear.cpp) once its shape's layout is probed: probe now, at load,
            # rather than in a request's first step.
            probe = torch.empty(1, layer.in_features, dtype=torch.bfloat16)
            layer.amx_decode = ops.amx_linear_applies(probe, layer.packed_weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.native:
            return ops.onednn_linear(x, layer.packed_weight, layer.bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")[:rows]

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # (oneDNN's bf16 GEMM rounds its output to bf16: on AVX512-BF16 CPUs without AMX the logits
        # are those, widened)
        if layer.amx_decode:
            return ops.amx_logits(x, layer.packed_weight, layer.bias)
        return self.apply(layer, x).float()

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        if activations == torch.bfloat16 and layer.native and layer.packed_weight.dtype == torch.bfloat16:
            return FusedProjection(layer.packed_weight, None, layer.bias)
        return None

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return [layer.packed_weight]

    def describe(self, layer: Linear) -> str:
        return self.name + (" (AMX decode)" if getattr(layer, "amx_decode", False) else "")


PANELS = PanelLinearMethod()
PAIR_PANELS = PairPanelLinearMethod()
ONEDNN = OneDnnLinearMethod()


def packed_method_for(dtype: torch.dtype, batch_invariant: bool = False) -> LinearMethod | None:
    """The packed method a CPU weight of this dtype gets, or None (it keeps the default GEMMs).
    `batch_invariant`: only methods whose rows do not depend on their step: on CPUs with AVX512-BF16
    but no AMX a bf16 weight leaves oneDNN for the pair panels (AMD) or the bf16 panels (Intel)."""
    caps = detect()
    panels = build.load() and caps.vector_isa != "generic"
    if dtype == torch.bfloat16 and batch_invariant and panels and not caps.amx_bf16:
        return PAIR_PANELS if caps.bf16_dot_outruns_fma and ops.bf16_pair_linear_supported() else PANELS
    panel_dtypes = (torch.float32,) if caps.native_bf16 else (torch.float32, torch.bfloat16)
    if dtype in panel_dtypes and panels:
        # (a generic build is scalar code; oneDNN picks vector code at run time. bf16 where the CPU
        # has no native bf16: torch's bf16 GEMMs are slower there than its fp32 ones.)
        return PANELS
    # oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on AVX2-only CPUs it raises.
    onednn_dtypes = (
        (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
    )
    if dtype in onednn_dtypes and onednn_linear_available():
        return ONEDNN
    return None


def panel_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of a weight's panels: its own, or bf16 for an fp32 weight whose every value is a bf16
    value (its low 16 bits are zero): the same numbers in half the bytes (see the module docstring)."""
    if weight.dtype == torch.float32 and not (weight.detach().view(torch.int32) & 0xFFFF).any():
        return torch.bfloat16
    return weight.dtype


def has_row_invariant_method(dtype: torch.dtype) -> bool:
    """Whether packed_method_for(dtype, batch_invariant=True) is a method whose rows do not depend on
    their step here: the panels, the pair panels, or bf16 on AMX tiles."""
    method = packed_method_for(dtype, batch_invariant=True)
    return method in (PANELS, PAIR_PANELS) or (method is ONEDNN and dtype == torch.bfloat16 and detect().amx_bf16)
