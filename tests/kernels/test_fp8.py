"""The FP8 kernel (kernels/csrc/cpu/fp8_linear.cpp): e4m3 weight bytes widened to fp32 and scaled as
they stream. Every finite e4m3 value (subnormals too) comes out exactly, each weight is exactly
fp8 * scale, and products are fp32 sums of those weights."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import build, ops
from tokenmill.models.layers.quantization.fp8 import pack_fp8

needs_kernels = pytest.mark.skipif(not build.load(), reason="tokenmill's CPU kernels are not built here")

# Every e4m3fn byte but its two NaNs.
FINITE_E4M3 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def _run(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, group_size: int, bias=None) -> torch.Tensor:
    packed, packed_scales = pack_fp8(values, scales, ops.linear_panel_width())
    return ops.fp8_linear(x, packed, packed_scales, group_size, bias, values.shape[0])


def _weight(values: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp8 * scale per weight, in fp32 (as a float model carrying the checkpoint holds it)."""
    k = values.shape[1]
    return values.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(group_size, dim=1)[:, :k]


def _case(n: int, k: int, group_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    values = FINITE_E4M3[torch.randint(0, len(FINITE_E4M3), (n, k), generator=gen)]
    scales = torch.rand(n, -(-k // group_size), generator=gen) * 0.01 + 1e-4
    return values, scales, gen


@needs_kernels
@pytest.mark.parametrize("n", [254, 70])
def test_fp8_weights_widen_exactly(n):
    """x = the identity: each output is one weight, fp8 * scale, bit for bit (every finite e4m3 byte)."""
    k = 96
    values = FINITE_E4M3.repeat(-(-n * k // len(FINITE_E4M3)))[: n * k].view(n, k)
    scales = torch.rand(n, 1, generator=torch.Generator().manual_seed(n)) + 0.5
    assert torch.equal(_run(torch.eye(k), values, scales, k), _weight(values, scales, k).t())


@needs_kernels
@pytest.mark.parametrize(
    ("rows", "k", "n", "group_size"),
    [(1, 64, 40, 64), (1, 256, 256, 128), (3, 200, 70, 128), (13, 384, 128, 128), (40, 100, 33, 100)],
)
def test_fp8_linear_sums_the_scaled_weights(rows, k, n, group_size):
    """Per-channel scales (one group) and block scales (groups of 128 inputs, the last one short)."""
    values, scales, gen = _case(n, k, group_size, seed=rows * k + n)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    weight = _weight(values, scales, group_size).double()
    exact = x.double() @ weight.t() + bias.double()
    got = _run(x, values, scales, group_size, bias)
    fp32_sums = 1e-6 * (x.double().abs() @ weight.abs().t() + bias.double().abs()) + 1e-30
    assert bool(((got.double() - exact).abs() <= fp32_sums).all())


@needs_kernels
def test_fp8_rows_do_not_depend_on_their_batch():
    values, scales, gen = _case(70, 256, 128, seed=3)
    x = torch.randn(131, 256, generator=gen)
    alone = torch.cat([_run(row[None], values, scales, 128) for row in x])
    for size in (2, 5, 12, 13, 64, 131):
        assert torch.equal(_run(x[:size], values, scales, 128), alone[:size]), size


@needs_kernels
def test_fp8_keeps_dtype_and_leading_dims():
    values, scales, gen = _case(40, 64, 64, seed=4)
    out = _run(torch.randn(2, 3, 64, generator=gen).bfloat16(), values, scales, 64)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16


@needs_kernels
def test_fp8_linear_rejects_bad_inputs():
    values, scales, _ = _case(40, 256, 128, seed=5)
    packed, packed_scales = pack_fp8(values, scales, ops.linear_panel_width())
    with pytest.raises(RuntimeError, match="e4m3 bytes in panels"):
        ops.fp8_linear(torch.zeros(1, 128), packed, packed_scales, 128, None, 40)
    with pytest.raises(RuntimeError, match="fp32 scales"):
        ops.fp8_linear(torch.zeros(1, 256), packed, packed_scales, 64, None, 40)  # 4 groups, not 2
    with pytest.raises(RuntimeError, match="fp32 scales"):
        ops.fp8_linear(torch.zeros(1, 256), packed, packed_scales.half(), 128, None, 40)
    with pytest.raises(RuntimeError, match="group size"):
        ops.fp8_linear(torch.zeros(1, 256), packed, packed_scales, 0, None, 40)
