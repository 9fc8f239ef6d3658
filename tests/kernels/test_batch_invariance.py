"""Batch invariance of the CPU kernels: a row's bits do not depend on the other rows of its step.

Attention: a query's output is the same whether it is decoded alone, is one row of a prefill chunk
(any split of the context into chunks, first chunk included) or shares the call with other
sequences. Linear layers: a row's output is the same alone and at any place of a step of any size.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_cpu_kernels import _case, _kernel, needs_kernels
from tokenmill.kernels import build, ops


def _sequence(c: dict, s: int) -> dict:
    """Sequence s of a case whose queries are every position of its context."""
    first = sum(ctx for ctx, _ in c["seqs"][:s])
    ctx = c["seqs"][s][0]
    return dict(c, seqs=[(ctx, ctx)], tables=[c["tables"][s]], q=c["q"][first : first + ctx])


def _rows(c: dict, calls: list[list[tuple[int, int]]], attend=_kernel) -> torch.Tensor:
    """Every position of one sequence's context (c from _sequence) computed by `calls`: each a list
    of query ranges [start, end) attended in one call of `attend` (the range's end its context)."""
    out = torch.empty_like(c["q"])
    for ranges in calls:
        q = torch.cat([c["q"][a:b] for a, b in ranges])
        got = attend(dict(c, seqs=[(b, b - a) for a, b in ranges], tables=c["tables"] * len(ranges), q=q))
        row = 0
        for a, b in ranges:
            out[a:b] = got[row : row + b - a]
            row += b - a
    return out


def _random_split(rng: random.Random, ctx: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, ctx), min(ctx - 1, rng.randint(0, 6)))) if ctx > 1 else []
    bounds = [0, *cuts, ctx]
    return list(zip(bounds, bounds[1:]))


CACHE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
]


@needs_kernels
@pytest.mark.parametrize("q_dtype, cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_a_query_has_the_same_bits_decoded_alone_in_any_chunk_or_batch(seed, q_dtype, cache_dtype):
    """Each position of a context attended as a decode alone, as a row of the whole context's prefill,
    of a random split into chunks (chunked prefill, speculative verification) and of those chunks
    run in one call with chunks of the context's other positions: bit-identical outputs (random
    head sizes with and without vector tails, GQA, block sizes, sliding windows, softcaps, block
    tables that jump around the cache)."""
    check_split_invariance(seed, q_dtype, cache_dtype, _kernel)


def check_split_invariance(
    seed: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, attend, max_context: int = 300
) -> None:
    """The test above for an attention `attend(case) -> out`, contexts of up to `max_context` keys."""
    from tokenmill.models.layers.kv_quant import to_cache

    rng = random.Random(seed)
    c = _case(rng, q_dtype, seqs=[(rng.randint(1, max_context), 0) for _ in range(2)])
    c["seqs"] = [(ctx, ctx) for ctx, _ in c["seqs"]]
    total = sum(ctx for ctx, _ in c["seqs"])
    heads = c["k_cache"].shape[1] * rng.choice([1, 2, 3])
    c["q"] = (torch.randn(total, heads, c["q"].shape[2], generator=torch.Generator().manual_seed(seed)) * 2).to(q_dtype)
    if cache_dtype != q_dtype:  # (unowned slots stay NaN: a read outside the context poisons the output)
        c["k_cache"], c["v_cache"] = (to_cache(cache.float(), cache_dtype) for cache in (c["k_cache"], c["v_cache"]))
    for s in range(len(c["seqs"])):
        one = _sequence(c, s)
        ctx = one["seqs"][0][0]
        alone = _rows(one, [[(p, p + 1)] for p in range(ctx)], attend)
        assert not alone.isnan().any()
        splits = {
            "the whole context in one chunk": [[(0, ctx)]],
            "chunks one after another": [[r] for r in _random_split(rng, ctx)],
            "chunks in one call": [_random_split(rng, ctx)],
        }
        for name, calls in splits.items():
            assert torch.equal(_rows(one, calls, attend), alone), (name, calls, c["window"], c["softcap"])


def _pair_kernel_here() -> bool:
    return build.load() and ops.bf16_pair_linear_supported()


needs_pair_kernel = pytest.mark.skipif(
    not _pair_kernel_here(), reason="no AVX512-BF16 here (or the kernels are built without AVX-512)"
)


def _assert_rows_invariant(product, x: torch.Tensor) -> torch.Tensor:
    """product(x[rows]) row for row equal to each row alone, for steps of many sizes and places;
    returns the rows alone."""
    alone = torch.cat([product(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in (2, 3, 6, 7, 12, 13, 25, 64, x.shape[0]):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows
    assert torch.equal(product(x[5:40]), alone[5:40])
    return alone


@needs_pair_kernel
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (37, 100), (64, 33)])
def test_pair_panels_are_exact_bf16_products_summed_in_fp32_whatever_the_step(in_features, out_features):
    """bf16 x times bf16 weights packed by pairs of inputs (AVX512-BF16 dot products): within fp32
    summation of a float64 product (odd K, a last partial panel, a bias), each row's bits the same
    alone and in steps of any size and place, the bf16 output the fp32 logits rounded."""
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(300, in_features, generator=gen).bfloat16()
    packed = ops.pack_bf16_pairs(weight)
    logits = _assert_rows_invariant(lambda rows: ops.bf16_pair_logits(rows, packed, bias, out_features), x)
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(logits.double(), expected, atol=1e-4 * in_features**0.5, rtol=1e-5)
    linear = ops.bf16_pair_linear(x, packed, bias, out_features)
    assert linear.dtype == torch.bfloat16 and torch.equal(linear, logits.bfloat16())


@needs_pair_kernel
def test_pair_panels_reject_what_they_cannot_read():
    packed = ops.pack_bf16_pairs(torch.zeros(40, 64))
    with pytest.raises(RuntimeError, match="pack_bf16_pairs"):  # another K
        ops.bf16_pair_linear(torch.zeros(1, 32).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="pack_bf16_pairs"):  # an N the panels do not hold
        ops.bf16_pair_linear(torch.zeros(1, 64).bfloat16(), packed, None, 80)
    with pytest.raises(RuntimeError, match="bf16 CPU x"):
        ops.bf16_pair_linear(torch.zeros(1, 64), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ops.bf16_pair_linear(torch.zeros(1, 64).bfloat16(), packed, torch.zeros(39), 40)


@needs_kernels
@pytest.mark.parametrize("method", ["panels", "pair panels"])
def test_bf16_linear_methods_do_not_depend_on_their_batch(method):
    """bf16 activations on the float methods batch invariance uses: bf16 panels (widened to fp32 as
    they stream) and pair panels (AVX512-BF16); a layer's output and logits, and the weight it holds."""
    from tokenmill.models.layers.linear import linear_with
    from tokenmill.models.layers.packed_linear import PAIR_PANELS, PANELS

    if method == "pair panels" and not _pair_kernel_here():
        pytest.skip("no AVX512-BF16 here (or the kernels are built without AVX-512)")
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(1536, 200).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 1536, generator=gen))
    weight = linear.weight.detach().clone()
    layer = linear_with(linear, PANELS if method == "panels" else PAIR_PANELS)
    x = torch.randn(131, 1536, generator=gen).bfloat16()
    _assert_rows_invariant(layer, x)
    _assert_rows_invariant(layer.logits, x)
    assert torch.equal(layer.dequantized(torch.bfloat16), weight)


# CPU kinds by their flags (tests/engine/test_cpu_precision.py has fuller sets): (flags, vendor, the
# bf16 method with batch invariance, without it).
_AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
_INTEL, _AMD = "GenuineIntel", "AuthenticAMD"
CPU_KINDS = {
    "AVX2 only (AMD Zen 2/3)": ({"avx2", "fma"}, _AMD, "panels", "panels"),
    "AVX-512 without AVX512-BF16": (_AVX512, _INTEL, "panels", "panels"),
    "AVX512-BF16, no AMX, Intel": (_AVX512 | {"avx512_bf16"}, _INTEL, "panels", "onednn"),
    "AVX512-BF16, AMD Zen 4/5": (_AVX512 | {"avx512_bf16"}, _AMD, "pair panels", "onednn"),
    "AMX": (_AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, _INTEL, "onednn", "onednn"),
}


@needs_kernels
@pytest.mark.parametrize("kind", CPU_KINDS)
@pytest.mark.parametrize("invariant", [True, False])
def test_bf16_linears_go_to_row_invariant_kernels_on_every_cpu_kind(monkeypatch, kind, invariant):
    """Which method a bf16 linear layer gets: oneDNN only where batch invariance is off or its AMX
    tiles keep rows invariant; fp32 always on panels."""
    from tokenmill.kernels.cpu_caps import caps_from_flags
    from tokenmill.models.layers import packed_linear

    flags, vendor, with_invariance, without = CPU_KINDS[kind]
    monkeypatch.setattr(packed_linear, "detect", lambda: caps_from_flags(flags, "AVX512", vendor))
    expected = with_invariance if invariant else without
    if expected == "pair panels" and not _pair_kernel_here():
        expected = "panels"  # (no AVX512-BF16 here to run them)
    onednn_bf16 = packed_linear.onednn_linear_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if expected == "onednn" and not onednn_bf16:
        pytest.skip("no oneDNN bf16 here")
    method = packed_linear.packed_method_for(torch.bfloat16, invariant)
    assert method is not None and method.name == expected
    assert packed_linear.packed_method_for(torch.float32, invariant) is packed_linear.PANELS
