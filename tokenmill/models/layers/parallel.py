"""Tensor parallelism (Megatron-style) for the Llama family: attention heads and MLP columns are
split over ranks, each row-parallel output (o_proj, down_proj) is summed with one all-reduce.

Embedding, norms and lm_head stay whole on every rank (they are small next to the layers of the
models this targets, and rank 0 alone computes logits). Works over gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.models.spec import ModelSpec


@dataclass(frozen=True)
class TPInfo:
    rank: int
    world_size: int

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


NO_TP = TPInfo(0, 1)


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Sum the partial outputs of a row-parallel layer over all ranks (in place)."""
    if tp.enabled:
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def check_shardable(spec: ModelSpec, world_size: int) -> None:
    if world_size == 1:
        return
    from tokenmill.models.model_loader.registry import architectures, lookup

    if not getattr(lookup(spec.model_type).model_class, "supports_tensor_parallel", False):
        capable = ", ".join(
            a.model_type for a in architectures() if getattr(a.model_class, "supports_tensor_parallel", False)
        )
        raise ValueError(
            f"--tensor-parallel-size > 1 supports the Llama family and its kin ({capable}), not {spec.model_type}"
        )
    for what, value in (
        ("attention heads", spec.num_heads),
        ("key/value heads", spec.num_kv_heads),
        ("MLP intermediate size", spec.intermediate_size),
    ):
        if value % world_size:
            raise ValueError(f"--tensor-parallel-size {world_size} must divide the model's {what} ({value})")


def local_spec(spec: ModelSpec, tp: TPInfo) -> ModelSpec:
    """The shapes one rank holds: its share of heads and of the MLP's intermediate columns."""
    if not tp.enabled:
        return spec
    n = tp.world_size
    return replace(
        spec,
        num_heads=spec.num_heads // n,
        num_kv_heads=spec.num_kv_heads // n,
        intermediate_size=spec.intermediate_size // n,
    )


def shard_state(state: dict[str, torch.Tensor], spec: ModelSpec, tp: TPInfo) -> dict[str, torch.Tensor]:
    """This rank's slice of a full (fused) Llama-family state dict."""
    if not tp.enabled:
        return state
    n, r = tp.world_size, tp.rank
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size

    def rows(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        # A fused column-parallel weight: shard each part (q, k, v or gate, up) on its own.
        return torch.cat([part.chunk(n, dim=0)[r] for part in t.split(sizes, dim=0)], dim=0).contiguous()

    out = {}
    for name, t in state.items():
        if ".qkv_proj." in name:
            t = rows(t, [q, kv, kv])
        elif ".gate_up_proj." in name:
            t = rows(t, [inter, inter])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = t.chunk(n, dim=1)[r].contiguous()
        elif name.endswith(("o_proj.bias", "down_proj.bias")) and r:
            t = torch.zeros_like(t)  # added once, by rank 0, before the all-reduce sums the ranks
        out[name] = t
    return out
