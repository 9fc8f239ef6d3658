"""Linear layers with their weights packed once at load, for CPU inference (`--packed-linear`).

PyTorch runs a CPU `nn.Linear` through MKL's sgemm, which on this project's AMD CPUs takes a slow
code path (0.7-0.8x oneDNN's rate on decode-batch shapes, ~0.7x at one row).
Two packings replace it, chosen by the weight's dtype:

- fp32 (`PanelLinear`): tokenmill's panel GEMM (kernels/csrc/cpu/panel_linear.cpp): the weight in
  panels of 16 (AVX2) or 32 (AVX-512) output columns, k-major, which one row streams at memory
  speed and many rows multiply from registers. Against oneDNN's packed fp32 weights on SmolLM2's
  layer shapes (`tokenmill bench kernels`, AMD Zen3): 1.4-1.8x at one row, 1.3-1.5x at 16, ~1.3x at
  64, 1.05-1.3x at 128-256.
- bf16 on a CPU without native bf16 (AMX or AVX512-BF16) goes to the same panel GEMM, each weight
  widened to fp32 as it streams (half the bytes of fp32, fp32 arithmetic).
- fp32 weights whose every value is a bf16 value (a model published in bf16, run in fp32: SmolLM2)
  are held in bf16 panels too: the kernel widens them back exactly, so the results are the fp32
  panels' bit for bit, from half the bytes (batch-1 decode streams the weights once per step).
- bf16 on CPUs with native bf16, or fp32 where tokenmill's kernels cannot be built (`OneDnnLinear`):
  oneDNN with the weight reordered into its blocked layout (AMX / AVX512-BF16). On AMX CPUs, steps
  of up to 64 rows (decode) read that same weight with tokenmill's AMX tiles instead
  (kernels/csrc/cpu/amx_linear.cpp: up to 32 rows bit-identical to oneDNN's results at ~1.3x its speed;
  33-64 rows as chunks of 32, each row's bits those it has in any step, close to oneDNN's own
  blocking of those rows, ~1.05-1.1x its speed).

Either way the math stays in the weight's dtype with fp32 accumulation; only the blocking and the
order of the sums differ, like any other BLAS. MoE expert weights are not nn.Linear modules and
stay stacked on `grouped_mm` (see moe.py).
"""

from __future__ import annotations

import itertools
import logging
import mmap
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.kernels import build, ops
from tokenmill.kernels.cpu_caps import detect

logger = logging.getLogger(__name__)

# oneDNN's reorder takes a typical row count; 64 (a decode batch) was as fast as a matching hint for
# 8 to 1024 rows, while a hint of 1 halved the speed of batches.
_BATCH_HINT = 64


def padded_rows(rows: int) -> int:
    """Row counts rounded up to buckets. oneDNN builds (JIT-compiles) a primitive for every new input
    shape (2-4 ms for one of SmolLM2's layer GEMMs); a step's token count takes hundreds of values,
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


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed at load (a plain tensor, not a Parameter: inference only)."""

    def __init__(self, linear: nn.Linear, packed_weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = packed_weight
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # e.g. [1, T, in] from HF modules (the generic path): rows are rows
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return self.forward_rows(x)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x W^T (+ b) of x [rows, in_features] (a vocabulary projection): the layer's output
        widened; a layer whose kernel sums in fp32 returns those sums, not rounded to x's dtype first."""
        return self.forward_rows(x).float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(PackedLinear):
    """fp32 (or bf16 where the CPU has no native bf16: widened to fp32 as the weight streams, half
    the bytes), on tokenmill's panel GEMM: any row count, and a row's result does not depend on the
    other rows of its step. `storage`: where to keep the packed weight (panel_numel(linear) values of
    its dtype, panel_dtype(linear.weight); default: its own tensor of that dtype)."""

    def __init__(self, linear: nn.Linear, storage: torch.Tensor | None = None) -> None:
        dtype = storage.dtype if storage is not None else panel_dtype(linear.weight)
        packed = ops.pack_linear_weight(linear.weight.detach().to(dtype))
        if storage is not None:
            packed = storage.view(packed.shape).copy_(packed)
        super().__init__(linear, packed)

    @staticmethod
    def panel_numel(linear: nn.Linear) -> int:
        width = ops.linear_panel_width()
        return -(-linear.out_features // width) * width * linear.in_features

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_logits(x, self.packed_weight, self.bias, self.out_features)


class PanelEmbedding(nn.Module):
    """The token embedding of a model whose lm_head shares (ties) its matrix, read from the head's
    panel-packed copy: row v of the matrix is column v % width of panel v // width. One copy of the
    vocabulary matrix instead of two (SmolLM2: 113 MB at fp32); a lookup reads one strided row per
    token, nothing next to the head's full pass over the matrix every step."""

    def __init__(self, embedding: nn.Embedding, head: PanelLinear) -> None:
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


class OneDnnLinear(PackedLinear):
    """fp32 or bf16, W held as an opaque oneDNN tensor. With tokenmill's kernels built, a call is the
    C++ op that the fused decoder layers call too (the same padding, the same result)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT))
        self.native = build.load()
        self.amx_decode = False
        if self.native and linear.weight.dtype == torch.bfloat16:
            # Decode-sized steps on AMX CPUs read this weight with tokenmill's AMX tiles
            # (kernels/csrc/cpu/amx_linear.cpp) once its shape's layout is probed: probe now, at load,
            # rather than in a request's first step.
            probe = torch.empty(1, self.in_features, dtype=torch.bfloat16)
            self.amx_decode = ops.amx_linear_applies(probe, self.packed_weight)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", amx_decode=True" if self.amx_decode else "")

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return ops.onednn_linear(x, self.packed_weight, self.bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")[:rows]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # (oneDNN's bf16 GEMM rounds its output to bf16: on AVX512-BF16 CPUs without AMX the logits
        # are those, widened)
        if self.amx_decode:
            return ops.amx_logits(x, self.packed_weight, self.bias)
        return super().logits(x)


def packing_for(weight: torch.Tensor) -> type[PackedLinear] | None:
    """The packed layer a CPU weight of this dtype gets, or None (it keeps the default GEMMs)."""
    if weight.device.type != "cpu":
        return None
    panel_dtypes = (torch.float32,) if detect().native_bf16 else (torch.float32, torch.bfloat16)
    if weight.dtype in panel_dtypes and build.load() and detect().vector_isa != "generic":
        # (a generic build is scalar code; oneDNN picks vector code at run time. bf16 where the CPU
        # has no native bf16: torch's bf16 GEMMs ran batch-1 decode at 27 ms/step there, fp32 at 20.)
        return PanelLinear
    # oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on AVX2-only CPUs it raises.
    onednn_dtypes = (
        (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
    )
    if weight.dtype in onednn_dtypes and onednn_linear_available():
        return OneDnnLinear
    return None


def panel_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of a weight's panels: its own, or bf16 for an fp32 weight whose every value is a bf16
    value (its low 16 bits are zero): the same numbers in half the bytes (see the module docstring)."""
    if weight.dtype == torch.float32 and not (weight.detach().view(torch.int32) & 0xFFFF).any():
        return torch.bfloat16
    return weight.dtype


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of (uint8) memory, advised for transparent huge pages where the OS offers them.
    A decode step streams every weight once: with 4 KiB pages that is a TLB miss, and a stop of the
    hardware prefetcher, every 1,024 floats (one row of panel GEMMs over SmolLM2's layers: 1.09x
    faster from 2 MiB pages, 13.1 vs 14.3 ms)."""
    try:
        region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # no THP (or no madvise) here: ordinary pages
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # keeps `region` alive


# Offsets of tensors in a shared huge-page buffer are multiples of this many bytes (a cache line).
_ALIGN_BYTES = 64


def _aligned_starts(nbytes: list[int]) -> list[int]:
    return list(itertools.accumulate((-(-n // _ALIGN_BYTES) * _ALIGN_BYTES for n in nbytes), initial=0))


def _view(buffer: torch.Tensor, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` values of `dtype` at byte `start` of a uint8 buffer."""
    return buffer[start : start + numel * dtype.itemsize].view(dtype)


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU tensors, one after another in one huge-page buffer (see huge_page_buffer)."""
    starts = _aligned_starts([t.numel() * t.element_size() for t in tensors])
    buffer = huge_page_buffer(starts[-1])
    return [_view(buffer, start, t.numel(), t.dtype).view(t.shape).copy_(t) for t, start in zip(tensors, starts)]


# {id(a layer's float weight): (that weight, the layer now computing with it)}: the weight is held
# so that its id stays its own while the map lives.
TiedHeads = dict[int, tuple[torch.Tensor, nn.Module]]


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear of a CPU fp32/bf16 model by its packed layer (see the module
    docstring; other dtypes and CPUs keep the default GEMMs); returns how many. The panel-packed
    weights share one huge-page buffer, and an embedding tied to a panel-packed layer reads it
    (PanelEmbedding) instead of keeping its own copy."""
    targets = [
        (module, name, child, packing_for(child.weight))
        for module in list(model.modules())
        for name, child in list(module.named_children())
        if type(child) is nn.Linear
    ]
    targets = [t for t in targets if t[3] is not None]
    numels = [PanelLinear.panel_numel(child) if kind is PanelLinear else 0 for _, _, child, kind in targets]
    dtypes = [panel_dtype(child.weight) if kind is PanelLinear else child.weight.dtype for _, _, child, kind in targets]
    starts = _aligned_starts([n * dtype.itemsize for n, dtype in zip(numels, dtypes)])
    buffer = huge_page_buffer(starts[-1]) if starts[-1] else None
    counts: dict[str, int] = {}
    panel_of_weight: TiedHeads = {}
    for (module, name, child, kind), numel, dtype, start in zip(targets, numels, dtypes, starts):
        storage = _view(buffer, start, numel, dtype) if kind is PanelLinear else None
        packed = PanelLinear(child, storage) if kind is PanelLinear else kind(child)
        if isinstance(packed, PanelLinear) and packed.bias is None:
            panel_of_weight[id(child.weight)] = (child.weight, packed)
        setattr(module, name, packed)
        narrowed = dtype != child.weight.dtype
        label = kind.__name__ + (" (bf16-valued fp32 weights, in bf16)" if narrowed else "")
        counts[label] = counts.get(label, 0) + 1
    if tied := read_tied_embeddings_from(panel_of_weight, model, PanelEmbedding):
        counts["PanelEmbedding"] = tied
    logger.info("packed layers: %s", ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none")
    return len(targets)


def read_tied_embeddings_from(
    heads: TiedHeads, model: nn.Module, reader: Callable[[nn.Embedding, nn.Module], nn.Module]
) -> int:
    """Replace every nn.Embedding whose weight one of `heads` was built from by reader(embedding,
    head), an embedding reading its rows from the head's copy (the float table is then dropped with
    the embedding: one copy of a tied vocabulary matrix); returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            entry = heads.get(id(child.weight)) if type(child) is nn.Embedding else None
            if entry is not None and child.max_norm is None:
                setattr(module, name, reader(child, entry[1]))
                count += 1
    return count
