"""Weight-only int8's group scales: each group's is the least-error bf16 scale of its candidates."""

from __future__ import annotations

import pytest
import torch

import tokenmill.models.layers.quantization.int8 as quant
from tokenmill.kernels import build

needs_kernels = pytest.mark.skipif(not build.load(), reason="kernels off (no C++ toolchain or TOKENMILL_CPU_KERNELS=0)")


def _groups(size: int) -> torch.Tensor:
    """Gaussian groups, groups with an outlier, groups of zeros, and groups on a 4-bit grid."""
    gen = torch.Generator().manual_seed(7)
    gaussian = torch.randn(300, size, generator=gen) * 0.05
    outlier = gaussian[:50].clone()
    outlier[:, 3] = 0.9
    zeros = torch.zeros(4, size)
    step = torch.rand(200, 1, generator=gen) * 0.01 + 0.001
    low = -step * (torch.rand(200, 1, generator=gen) * 15)
    grid = low + step * torch.randint(0, 16, (200, size), generator=gen).float()
    return torch.cat([gaussian, outlier, zeros, grid])


def _errors(groups: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared error [G, candidates] of each candidate scale, first candidate's bits [G])."""
    first = quant.round_up_to_bf16(groups.abs().amax(-1).clamp(min=1e-8) / 127.0).view(torch.int16)
    errors = []
    for j in range(candidates):
        s = (first + j).view(torch.bfloat16).float()[:, None]
        errors.append((torch.round(groups / s).clamp(-127, 127) * s - groups).square().sum(-1))
    return torch.stack(errors, 1), first


def _assert_least_error(groups: torch.Tensor, scales: torch.Tensor, candidates: int) -> None:
    errors, first = _errors(groups, candidates)
    picked = scales.view(torch.int16).long() - first.long()
    assert ((picked >= 0) & (picked < candidates)).all()
    chosen = errors.gather(1, picked[:, None])[:, 0]
    least = errors.min(1).values
    # (the sums' order differs between implementations: equal to the least up to its rounding)
    assert torch.all(chosen <= least * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("size", [32, 40])  # a whole vector count, and a scalar tail
def test_torch_search_picks_the_least_error_scale(monkeypatch, size):
    monkeypatch.setattr(quant, "cpu_kernels_available", lambda device: False)
    groups = _groups(size)
    _assert_least_error(groups, quant.group_scales(groups, 64), 64)


@needs_kernels
@pytest.mark.parametrize("size", [32, 40])
def test_kernel_search_picks_the_least_error_scale_as_torch_does(monkeypatch, size):
    groups = _groups(size)
    kernel = torch.ops.tokenmill.int8_group_scales(groups, 64)
    _assert_least_error(groups, kernel, 64)
    monkeypatch.setattr(quant, "cpu_kernels_available", lambda device: False)
    assert torch.equal(kernel.view(torch.int16), quant.group_scales(groups, 64).view(torch.int16))


def test_weights_on_a_coarser_grid_come_back_exactly():
    """4-bit levels (min + step * q, q in 0..15, as a GGUF Q4_1 block dequantises) with a power-of-two
    step and a centred minimum: step / 16 is a candidate and reproduces every weight, where the
    round-to-nearest scale (the first candidate) does not."""
    gen = torch.Generator().manual_seed(3)
    step = 2.0 ** torch.randint(-9, -5, (64, 1), generator=gen).float()
    weight = -7.5 * step + step * torch.randint(0, 16, (64, 64), generator=gen).float()
    weight = weight.view(128, 32)  # each row of 64 is two groups sharing the row's grid
    q, scales = quant.quantize_weight(weight, 32)
    dequantized = (q.float().view(128, 1, 32) * scales.float()[..., None]).view(128, 32)
    assert torch.equal(dequantized, weight)
    errors, _ = _errors(weight, 1)
    assert errors[:, 0].sum() > 0  # round to nearest alone would not
