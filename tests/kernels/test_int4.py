"""4-bit weight-only layers (models/layers/quantization/int4.py, kernels/csrc/cpu/int4_linear.cpp): the
kernel computes its dequantized weight times activations rounded to int16 per group, for every zero
point form (one for all, per group and output) and with offsets; a row's result does not depend on its
batch; `--quantization int4`'s groups reproduce 4-bit grids exactly."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import build, ops
from tokenmill.models.layers.quantization.int4 import (
    Int4Weight,
    affine_groups,
    pack_values,
    pack_zeros,
)
from tokenmill.models.layers.quantization.int8 import panels

needs_kernels = pytest.mark.skipif(not build.load(), reason="tokenmill's CPU kernels are not built here")


def _random_weight(n: int, k: int, groups: int, zeros: str, offsets: bool, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.1 + 0.01).half()
    per_group = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8) if zeros == "per group" else None
    shift = (torch.randn(n, groups, generator=gen) * 0.05).half() if offsets else None
    return Int4Weight(values, scales, per_group, 8 if zeros == "8" else 0, shift, None)


def _run(weight: Int4Weight, x: torch.Tensor, bias: torch.Tensor | None, logits: bool = False) -> torch.Tensor:
    width = ops.linear_panel_width()
    n = weight.values.shape[0]
    zeros = pack_zeros(weight.zeros, width) if weight.zeros is not None else None
    offsets = panels(weight.offsets, width) if weight.offsets is not None else None
    op = ops.packed_int4_logits if logits else ops.packed_int4_linear
    return op(x, pack_values(weight.values, width), panels(weight.scales, width), zeros, weight.zero, offsets, bias, n)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 40])
@pytest.mark.parametrize(("k", "n", "groups"), [(64, 40, 2), (576, 200, 18), (96, 33, 1), (1024, 64, 8)])
@pytest.mark.parametrize(("zeros", "offsets"), [("8", False), ("per group", False), ("0", True)])
def test_int4_linear_is_its_dequantized_weight_times_int16_activations(rows, k, n, groups, zeros, offsets):
    weight = _random_weight(n, k, groups, zeros, offsets, seed=rows * 7 + k + n)
    gen = torch.Generator().manual_seed(k * n)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    got = _run(weight, x, bias).double()
    w = weight.dequantized().double()
    exact = x.double() @ w.t() + bias.double()
    size = k // groups  # each input off by at most half a step of its block's int16 scale
    blocks = x.double().view(rows, -1, min(size, 512))
    step = (blocks.abs().amax(dim=-1, keepdim=True) / 32767).expand_as(blocks).reshape(rows, k)
    bound = (step / 2) @ w.abs().t() + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-5
    assert bool(((got - exact).abs() <= bound).all())
    assert torch.equal(_run(weight, x, bias, logits=True), _run(weight, x, bias))  # fp32 x: the same sums


@needs_kernels
def test_int4_rows_do_not_depend_on_their_batch_and_bf16_rows_come_back_bf16():
    weight = _random_weight(70, 128, 4, "per group", True, seed=3)
    batch = torch.randn(67, 128)
    alone = torch.cat([_run(weight, row[None], None) for row in batch])
    for size in (2, 5, 6, 7, 64, 67):
        assert torch.equal(_run(weight, batch[:size], None), alone[:size]), size
    assert _run(weight, batch.bfloat16(), None).dtype == torch.bfloat16


@needs_kernels
def test_int4_linear_rejects_bad_inputs():
    weight = _random_weight(40, 64, 2, "8", False, seed=1)
    with pytest.raises(RuntimeError, match="4-bit panels"):  # another K
        _run(weight, torch.zeros(1, 32), None)
    width = ops.linear_panel_width()
    packed, scales = pack_values(weight.values, width), panels(weight.scales, width)
    with pytest.raises(RuntimeError, match="fp16 scales"):
        ops.packed_int4_linear(torch.zeros(1, 64), packed, scales.float(), None, 8, None, None, 40)
    with pytest.raises(RuntimeError, match="zero point"):
        ops.packed_int4_linear(torch.zeros(1, 64), packed, scales, None, 16, None, None, 40)


def test_affine_groups_reproduce_a_4_bit_grid_exactly():
    """Weights dequantized from 4-bit blocks of 32 (fp16 scale and minimum each, as GGUF's Q4_1) come
    back exactly; other weights with no more squared error per group than min-max's 16 levels."""
    gen = torch.Generator().manual_seed(0)
    scale = (torch.rand(48, 4, 1, generator=gen) * 0.02 + 0.001).half().float()
    low = (-torch.rand(48, 4, 1, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (48, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # (each block spans its levels, as a Q4_1 block's min and max do)
    grid = (q * scale + low).view(48, 128)
    assert torch.equal(affine_groups(grid).dequantized(), grid)
    w = torch.randn(48, 128, generator=gen)
    groups = w.view(-1, 32)
    lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    s = (hi - lo) / 15
    min_max = torch.round((groups - lo) / s) * s + lo
    error = (affine_groups(w).dequantized().view(-1, 32) - groups).square().sum(dim=1)
    assert bool((error <= (min_max - groups).square().sum(dim=1) * 1.01 + 1e-6).all())


@needs_kernels
@pytest.mark.parametrize("size", [32, 40])  # a whole vector count, and a scalar tail
def test_affine_groups_in_cpp_pick_as_the_torch_search(monkeypatch, size):
    """The C++ search (CPU) and the torch one (other devices) pick the same grids, up to candidates
    whose errors tie within the rounding of their sums."""
    import tokenmill.models.layers.quantization.int4 as int4

    gen = torch.Generator().manual_seed(size)
    w = torch.cat([torch.randn(300, size, generator=gen) * 0.05, torch.zeros(2, size), torch.ones(2, size)])
    w[:40, 5] = 0.8  # outliers: narrower ranges win
    native = affine_groups(w, size)
    monkeypatch.setattr(int4, "cpu_kernels_available", lambda device: False)
    reference = affine_groups(w, size)

    def errors(weight: Int4Weight) -> torch.Tensor:
        return (weight.dequantized() - w).square().sum(dim=1)

    same = (native.scales == reference.scales) & (native.offsets == reference.offsets)
    assert same.float().mean() > 0.95
    assert torch.equal(native.values[same[:, 0]], reference.values[same[:, 0]])
    assert bool((errors(native) <= errors(reference) * (1 + 1e-4) + 1e-12).all())
