"""The W8A8 kernel (kernels/csrc/cpu/w8a8_linear.cpp): int8 weights times activations rounded to int8
per row, against the exact integer sums scaled in the kernel's order (bit for bit), on every path the
CPU picks (AMX-int8, AVX512-VNNI / AVX-VNNI, or pmaddwd where it has no int8 dot products)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import build, cpu_caps, ops
from tokenmill.models.layers.quantization.w8a8 import pack_w8a8

needs_kernels = pytest.mark.skipif(not build.load(), reason="tokenmill's CPU kernels are not built here")

# (rows, K, N): one row (panels six at a time), a few (one row at a time), register tiles with tails,
# AMX's 16 rows and more; K with and without a multiple of 64 (the padded quads), N with a partial panel.
SHAPES = [(1, 64, 40), (1, 200, 192), (3, 576, 70), (12, 100, 33), (13, 64, 96), (16, 576, 200), (40, 130, 65)]


def _case(rows: int, k: int, n: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-4
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
    b = torch.randn(n, generator=gen) if bias else None
    return x, values, scales, b


def _reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row rounded to int8 by max|row| / 127 (torch.round of the quotient), the integer sums exact,
    then (float(sum) * s_x) * s_w + bias in fp32, the last step one fused multiply-add (as the kernel
    computes it: here the product is exact in fp64 and the sum rounded to fp64, then to fp32)."""
    sx = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.round(x / sx).clamp(-127, 127)
    sums = (q.double() @ values.double().t()).float()  # (exact: |sum| < 2^24 here)
    product = sums * sx
    if bias is None:
        return product * scales
    return (product.double() * scales.double() + bias.double()).float()


def _run(x, values, scales, bias):
    packed, offsets, column_scales = pack_w8a8(values, scales, ops.linear_panel_width())
    return ops.w8a8_linear(x, packed, offsets, column_scales, bias, values.shape[0])


@needs_kernels
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_w8a8_linear_is_the_exact_int_sums_scaled(rows, k, n):
    x, values, scales, bias = _case(rows, k, n, seed=rows * k + n)
    assert torch.equal(_run(x, values, scales, bias), _reference(x, values, scales, bias))
    assert torch.equal(_run(x, values, scales, None), _reference(x, values, scales, None))


@needs_kernels
def test_w8a8_rows_do_not_depend_on_their_batch():
    x, values, scales, bias = _case(131, 320, 70, seed=5)
    x[7] *= 1000  # one row with far larger activations
    alone = torch.cat([_run(row[None], values, scales, bias) for row in x])
    for size in (2, 5, 12, 16, 17, 64, 131):
        assert torch.equal(_run(x[:size], values, scales, bias), alone[:size]), size


@needs_kernels
def test_w8a8_keeps_dtype_and_leading_dims_and_passes_non_finite_rows_on():
    x, values, scales, bias = _case(6, 64, 40, seed=9)
    out = _run(x.bfloat16().view(2, 3, 64), values, scales, bias)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    x[0, 3], x[1, 10] = float("inf"), float("nan")
    out = _run(x, values, scales, bias)
    assert not out[0].isfinite().any() and not out[1].isfinite().any() and out[2:].isfinite().all()
    zero = _run(torch.zeros(1, 64), values, scales, None)
    assert torch.equal(zero, torch.zeros(1, 40))


@needs_kernels
def test_w8a8_picks_the_cpus_int8_dot_products():
    caps = cpu_caps.detect()
    isa = caps.vector_isa
    dot_products = {"avx512": ("avx512-vnni", caps.avx512_vnni), "avx2": ("avx-vnni", caps.avx_vnni)}
    name, present = dot_products.get(isa, ("scalar", False))
    assert ops.w8a8_instructions(1) == (name if present else "pmaddwd" if isa != "generic" else "scalar")
    expected_amx = isa == "avx512" and caps.amx_int8 and bool(torch.ops.tokenmill.amx_int8_usable())
    assert (ops.w8a8_instructions(16) == "amx-int8") == expected_amx
    assert ops.w8a8_instructions(15) != "amx-int8"


_DOT_PRODUCTS_OFF = {"TOKENMILL_VNNI": "0", "TOKENMILL_AMX_INT8": "0"}


@needs_kernels
def test_w8a8_without_int8_dot_products_gives_the_same_bits(request):
    """With TOKENMILL_VNNI=0 and TOKENMILL_AMX_INT8=0 (read once per process: a child pytest, with
    this run's ISA-variant plugin) the kernel takes the pmaddwd path a CPU without VNNI runs, and
    the tests above pass on it unchanged."""
    if all(os.environ.get(name) == value for name, value in _DOT_PRODUCTS_OFF.items()):  # (the child)
        assert ops.w8a8_instructions(1) == ops.w8a8_instructions(64) == "pmaddwd"
        return
    if ops.w8a8_instructions(64) in ("pmaddwd", "scalar"):
        pytest.skip("this CPU has no int8 dot products: the tests above ran that path")
    plugins = [
        p
        for p in ("tests.isa_emulation.avx2", "tests.isa_emulation.avx512")
        if request.config.pluginmanager.has_plugin(p)
    ]
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(a for p in plugins for a in ("-p", p))]
    command += [str(Path(__file__).resolve()), "-k", "exact_int_sums or batch or without_int8_dot_products"]
    env = {**os.environ, **_DOT_PRODUCTS_OFF}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


@needs_kernels
def test_w8a8_linear_rejects_bad_inputs():
    x, values, scales, bias = _case(2, 64, 40, seed=1)
    packed, offsets, column_scales = pack_w8a8(values, scales, ops.linear_panel_width())
    with pytest.raises(RuntimeError, match="quad panels"):
        ops.w8a8_linear(torch.zeros(2, 65 + 64), packed, offsets, column_scales, None, 40)
    with pytest.raises(RuntimeError, match="column offsets"):
        ops.w8a8_linear(x, packed, offsets.float(), column_scales, None, 40)
    with pytest.raises(RuntimeError, match="column scales"):
        ops.w8a8_linear(x, packed, offsets, column_scales.half(), None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ops.w8a8_linear(x, packed, offsets, column_scales, torch.zeros(3), 40)
