"""LoRA-wrapped linear layers: base(x) plus, for the rows of each adapter, that adapter's delta.

Every linear layer a model family marks (a parent module's `lora_parts`: attribute name -> the
output sizes of its fused parts, e.g. q, k, v of `qkv_proj`) is wrapped once at load. Each wrapper
holds `max_loras` slots of stacked A and B matrices (zero when a slot's adapter does not target
the layer); a step's rows are grouped by slot and each group runs as one GEMM per matrix
(`grouped_mm`, the segmented GEMM of punica's SGMV), so one forward pass serves every adapter of
the batch, and rows of the base model cost nothing. When the groups are about equally large
(decode steps) they are padded to one width and run as one batched GEMM per matrix instead:
grouped_mm runs a GEMM per group on CPU, and those small GEMMs cost more than the padding.

Layout per wrapper with S fused parts and rank width R (`--max-lora-rank`): `lora_a` [slots,
S * R, in] holds the A matrices of all parts, `lora_b` [slots, S * R, out] the B matrices
transposed and block-diagonally (part i's rows read only its R rank columns), so on the GEMM
paths a layer costs one shrink and one expand GEMM whatever its parts. (Per-part expands read S
times fewer B weights but cost S - 1 more GEMMs and a concatenation; on SmolLM2's qkv and gate_up
shapes they were slower for decode-size groups and barely faster for prefill-size ones:
`tokenmill bench features --only LoRA`.) A
whole-layer adapter of a fused layer (Phi-3's `qkv_proj` targets) uses the first R columns for
every row. `blocks` [slots, S, 4] says where each slot's adapter really is (first rank column,
rank, output features): on CPU in fp32 every step runs the `lora_delta` kernel, which reads only
those blocks (a rank-8 adapter in a rank-16 slot, or the zeros off the block diagonal, cost
nothing) in one call per layer; GPUs and bf16 take the GEMM paths.
The adapter's scale (alpha / r) is folded into B when the adapter is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import ops
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.lora.batch import LoRABatch
from tokenmill.lora.types import LoRATarget, LoRAWeights
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.moe import grouped_mm_supported


@dataclass
class ActiveStep:
    """The step the model thread is running, as the wrapped layers read it (device tensors)."""

    rows: torch.Tensor  # the step's rows that have an adapter, grouped by slot
    slot_range: tuple[int, int]  # the slots [first, end) the GEMMs run over
    offsets: torch.Tensor  # int32 end of each of those slots' group in `rows` (grouped_mm's offs)
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) of every non-empty group
    slots: tuple[int, ...]  # the slots the step uses
    padded: tuple[torch.Tensor, torch.Tensor] | None  # LoRABatch.padded
    kernel_segments: torch.Tensor | None  # [groups, 3] int64 (slot, start, end) when the CPU kernel runs


class LoRALinear(nn.Module):
    """`base` (a Linear, computed by its method) plus per-slot LoRA deltas."""

    lora_a: torch.Tensor  # (buffers, registered in __init__)
    lora_b: torch.Tensor

    def __init__(
        self,
        base: Linear,
        target: LoRATarget,
        state: LoRAModel,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.state = state  # shared by every wrapper: which step is running
        self.max_rank = max_rank
        parts = len(target.part_sizes)
        # Buffers (not saved): they count in the model's memory, as they take it.
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, parts * max_rank, target.in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, parts * max_rank, target.out_features, dtype=dtype, device=device),
            persistent=False,
        )
        # Per slot and part: (first rank column, rank, first and end output feature) of the block the
        # adapter fills (rank 0: none). Host memory: read by the CPU kernel only.
        self.blocks = torch.zeros(max_loras, parts, 4, dtype=torch.long)
        self.filled = [False] * max_loras  # whether a slot's adapter adapts this layer (else skip the GEMMs)
        self.grouped = grouped_mm_supported(self.lora_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.quant_method.apply(self.base, x)
        step = self.state.active
        if step is None or not any(self.filled[s] for s in step.slots):
            return out
        if step.kernel_segments is not None and x.dim() == 2 and x.is_contiguous() and out.is_contiguous():
            ops.lora_delta(x, out, self.lora_a, self.lora_b, step.rows, step.kernel_segments, self.blocks)
            return out
        if step.padded is not None:
            delta = self._batched(x, step.padded, step.slot_range)
        else:
            shrunk = self._matmul(x.index_select(0, step.rows), self.lora_a.transpose(1, 2), step)
            delta = self._matmul(shrunk, self.lora_b, step)
        return out.index_add_(0, step.rows, delta)

    def _batched(
        self, x: torch.Tensor, padded: tuple[torch.Tensor, torch.Tensor], slot_range: tuple[int, int]
    ) -> torch.Tensor:
        """The deltas of the step's rows from batched GEMMs over the groups padded to one width."""
        gather, valid = padded
        first, end = slot_range
        blocks = x.index_select(0, gather).view(end - first, -1, x.shape[-1])
        shrunk = torch.bmm(blocks, self.lora_a[first:end].transpose(1, 2))
        delta = torch.bmm(shrunk, self.lora_b[first:end])
        return delta.view(-1, delta.shape[-1]).index_select(0, valid)

    def _matmul(self, x: torch.Tensor, weights: torch.Tensor, step: ActiveStep) -> torch.Tensor:
        """Each slot's group of rows times that slot's matrix (weights [slots, in, out])."""
        if self.grouped:
            first, end = step.slot_range
            return F.grouped_mm(x, weights[first:end], offs=step.offsets)
        out = x.new_zeros(x.shape[0], weights.shape[2])
        for slot, start, end in step.segments:
            torch.mm(x[start:end], weights[slot], out=out[start:end])
        return out

    @torch.no_grad()
    def load_slot(self, slot: int, weights: tuple[LoRAWeights, ...]) -> None:
        """Put one adapter's matrices for this layer into `slot` (all zero when it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.blocks[slot].zero_()
        sizes = self.target.part_sizes
        for w in weights:
            r = w.a.shape[0]
            part = 0 if w.part is None else w.part
            col = part * self.max_rank
            row = sum(sizes[:part])
            self.lora_a[slot, col : col + r] = w.a
            self.lora_b[slot, col : col + r, row : row + w.b.shape[0]] = w.b.t()
            self.blocks[slot, part] = torch.tensor([col, r, row, row + w.b.shape[0]])
        self.filled[slot] = bool(weights)

    def extra_repr(self) -> str:
        return f"parts={self.target.part_sizes}, slots={len(self.filled)}, max_rank={self.max_rank}"


class LoRAModel:
    """The model side of LoRA: the wrapped layers, what each slot holds, and the running step.
    Used by the model thread only (loads happen there, in step order, between forward passes)."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: dict[str, LoRALinear] = {}
        capable = list(_lora_capable(model))  # (collected before wrapping)
        _check_slot_memory(model, capable, max_loras, max_rank, dtype, device)
        for parent_name, parent, attr, sizes in capable:
            base = getattr(parent, attr)
            target = LoRATarget(base.in_features, tuple(sizes))
            wrapped = LoRALinear(base, target, self, max_loras, max_rank, dtype, device)
            setattr(parent, attr, wrapped)
            self.layers[f"{parent_name}.{attr}" if parent_name else attr] = wrapped
        if not self.layers:
            raise ValueError(
                f"LoRA: {type(model).__name__} has no layers LoRA adapters can target (supported: the "
                "native Llama-family models of `tokenmill models`: llama, mistral, qwen2, qwen3, gemma 1/2/3, "
                "phi3, and the attention of the MoE models)"
            )
        # Checkpoint (and so PEFT) names -> wrapped layer names: every model class has `hf_to_local`
        # (models/model_loader/registry.py), which nn.Module's type does not declare.
        self.hf_to_local: Callable[[str], tuple[str, int | None, Any]] = getattr(type(model), "hf_to_local")  # noqa: B009
        self.resident: list[int | None] = [None] * max_loras  # adapter id held by each slot
        self.active: ActiveStep | None = None
        # On CPU in fp32 the kernel serves every step: in the engine it cost a quarter of the GEMM
        # paths on 1,024-token prefill steps and a third on decode steps (SmolLM2, 4 adapters).
        self.kernel = dtype == torch.float32 and cpu_kernels_available(device)

    @property
    def targets(self) -> dict[str, LoRATarget]:
        return {name: layer.target for name, layer in self.layers.items()}

    def begin(self, batch: LoRABatch, device: torch.device) -> None:
        """Before a step's forward pass: load the adapters it needs into their slots, then let the
        wrapped layers see its row groups."""
        for slot, adapter in batch.adapters:
            if self.resident[slot] != adapter.id:
                self.resident[slot] = None  # (until every layer holds the new adapter)
                for name, layer in self.layers.items():
                    layer.load_slot(slot, adapter.weights.get(name, ()))
                self.resident[slot] = adapter.id
        self.active = ActiveStep(
            batch.rows.to(device, non_blocking=True),
            batch.slot_range,
            batch.offsets.to(device, non_blocking=True),
            batch.segments,
            tuple(slot for slot, _ in batch.adapters),
            None if batch.padded is None else _to_device(batch.padded, device),
            torch.tensor(batch.segments, dtype=torch.long) if self.kernel else None,
        )

    def end(self) -> None:
        self.active = None


def _to_device(pair: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return pair[0].to(device, non_blocking=True), pair[1].to(device, non_blocking=True)


def _check_slot_memory(
    model: nn.Module, capable: list, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse --max-loras x --max-lora-rank slots that do not fit in the free memory, naming the flags
    (rather than an allocator traceback at start)."""
    elements = sum(
        len(sizes) * max_rank * (getattr(parent, attr).in_features + sum(sizes)) for _, parent, attr, sizes in capable
    )
    needed = max_loras * elements * dtype.itemsize
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if needed > free // 2:
        raise ValueError(
            f"LoRA slots for --max-loras {max_loras} x --max-lora-rank {max_rank} need "
            f"{needed / 2**30:.1f} GiB, more than half the free memory ({free / 2**30:.1f} GiB): "
            "lower --max-loras or --max-lora-rank"
        )


def _lora_capable(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, tuple[int, ...]]]:
    """(parent name, parent, attribute, part sizes) of every linear layer the model marks."""
    for name, module in model.named_modules():
        for attr, sizes in getattr(module, "lora_parts", {}).items():
            yield name, module, attr, sizes
