"""The fused CPU paged-attention kernel (tokenmill/kernels) against SDPA on gathered K/V, and the
engine with the kernel on and off.

Random shapes: GQA ratios, head sizes with and without a vector tail, block sizes, sliding
windows, logit softcaps, decodes and multi-query chunks, block tables that jump around the cache
(holes, reversed order). Every cache slot no sequence owns holds NaN, so a read outside a
sequence's visible keys poisons the output.
"""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest
import torch

from tests.conftest import hf_greedy_batch, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker import model_runner
from tokenmill.engine.worker.model_runner import build_forward
from tokenmill.kernels import build
from tokenmill.models.layers.attention import AttentionMetadata, PagedQueries, _attend, paged_attention
from tokenmill.models.layers.kv_quant import from_cache, to_cache

needs_kernels = pytest.mark.skipif(not build.load(), reason="kernels off (no C++ toolchain or TOKENMILL_CPU_KERNELS=0)")


def _case(rng: random.Random, dtype: torch.dtype, seqs: list[tuple[int, int]] | None = None):
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 2, 3, 4, 8])
    dim = rng.choice([16, 36, 64, 80, 128])
    block = rng.choice([1, 4, 16])
    window = rng.choice([None, None, 1, 5, 33])
    softcap = rng.choice([None, None, 5.0])
    if seqs is None:  # (context, queries) per sequence
        seqs = []
        for _ in range(rng.randint(1, 5)):
            ctx = rng.randint(1, 150)
            q_len = 1 if rng.random() < 0.5 else rng.randint(1, ctx)
            seqs.append((ctx, q_len))
    num_blocks = 1 + sum(-(-ctx // block) for ctx, _ in seqs) + rng.randint(0, 8)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)  # tables jump around the cache, with unused blocks (holes) between them
    tables = []
    for ctx, _ in seqs:
        tables.append([ids.pop() for _ in range(-(-ctx // block))])
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    slots = num_blocks * block
    k_cache = torch.full((slots, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full((slots, kv_heads, dim), float("nan"), dtype=dtype)
    for (ctx, _), table in zip(seqs, tables):
        pos = torch.arange(ctx)
        owned = torch.tensor(table)[pos // block] * block + pos % block
        k_cache[owned] = (torch.randn(ctx, kv_heads, dim, generator=gen) * 2).to(dtype)
        v_cache[owned] = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
    total_q = sum(q for _, q in seqs)
    q = (torch.randn(total_q, heads, dim, generator=gen) * 2).to(dtype)
    return dict(
        seqs=seqs,
        tables=tables,
        block=block,
        window=window,
        softcap=softcap,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        scale=dim**-0.5,
    )


def _reference(c) -> torch.Tensor:
    """SDPA (or the explicit softcap path) per sequence on K/V gathered from the block table, in fp64."""
    outs, row = [], 0
    for (ctx, q_len), table in zip(c["seqs"], c["tables"]):
        pos = torch.arange(ctx)
        slots = torch.tensor(table)[pos // c["block"]] * c["block"] + pos % c["block"]
        k, v = c["k_cache"][slots].double(), c["v_cache"][slots].double()
        q = c["q"][row : row + q_len].double()
        query_pos = pos[ctx - q_len :]
        mask = pos[None, :] <= query_pos[:, None]
        if c["window"] is not None:
            mask &= pos[None, :] > query_pos[:, None] - c["window"]
        o = _attend(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, c["scale"], c["softcap"]
        )
        outs.append(o[0].transpose(0, 1))
        row += q_len
    return torch.cat(outs)


def _kernel(c) -> torch.Tensor:
    lens = [q for _, q in c["seqs"]]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    width = max(len(t) for t in c["tables"])
    paged = PagedQueries(
        query_start=torch.tensor(starts, dtype=torch.int32),
        query_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in c["tables"]], dtype=torch.int32),
        context_lens=torch.tensor([ctx for ctx, _ in c["seqs"]], dtype=torch.int32),
    )
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=c["block"], paged=paged)
    empty = c["q"][:0, : c["k_cache"].shape[1]]
    out = paged_attention(c["q"], empty, empty, c["k_cache"], c["v_cache"], meta, c["scale"], c["window"], c["softcap"])
    return out.view_as(c["q"])


def _assert_fp32_kernel_matches_reference(c) -> None:
    out = _kernel(c)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference(c), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("seed", range(60))
def test_fp32_kernel_matches_sdpa(seed):
    _assert_fp32_kernel_matches_reference(_case(random.Random(seed), torch.float32))


@needs_kernels
@pytest.mark.parametrize("decodes", [1, 3, 40])
@pytest.mark.parametrize("seed", range(4))
def test_decode_batches_small_and_large_match_sdpa(seed, decodes):
    """Few decodes split each sequence's keys (chunks of 128, all kv heads per item) or, under 129
    keys alone, its kv heads over the threads; many decodes read all kv heads of a slot row in one
    item. All equal the reference."""
    rng = random.Random(500 + seed)
    c = _case(rng, torch.float32, seqs=[(rng.randint(1, 300), 1) for _ in range(decodes)])
    _assert_fp32_kernel_matches_reference(c)


@needs_kernels
@pytest.mark.parametrize("seed", range(8))
def test_long_contexts_cut_into_key_chunks_match_sdpa(seed):
    """Keys are cut at fixed multiples (128) into items whose partial softmaxes are merged: decodes
    and prefill tiles over many chunks (rows that see none of a chunk, windows, softcaps) equal the
    reference."""
    rng = random.Random(3000 + seed)
    c = _case(
        rng, torch.float32, seqs=[(rng.randint(129, 1100), rng.choice([1, 1, 9, 40])) for _ in range(rng.randint(1, 3))]
    )
    _assert_fp32_kernel_matches_reference(c)


@needs_kernels
@pytest.mark.parametrize("seed", range(3))
def test_prefill_tiles_over_many_chunks_match_sdpa(seed):
    """Many query tiles (a long prefill chunk with cached context): each item computes its tile's key
    chunks one after another and merges them (no per-chunk items), rows masked differently in each
    chunk; equal to the reference, with every key visible or under a window or a softcap."""
    rng = random.Random(5000 + seed)
    c = _case(rng, torch.float32, seqs=[(rng.randint(600, 1100), rng.randint(33, 120)), (rng.randint(300, 700), 40)])
    assert sum(-(-q // 8) for _, q in c["seqs"]) >= 4 * torch.get_num_threads()  # (not split into chunk items)
    _assert_fp32_kernel_matches_reference(c)


@needs_kernels
def test_a_decode_is_bit_identical_alone_and_in_a_batch():
    """Alone, a decode over a long context is split over the threads by key chunks (an item each,
    merged afterwards); in a batch of 40 one item does its chunks in turn. Its row is the same bits
    either way, on any number of threads (a request's tokens never depend on who else is being
    served)."""
    rng = random.Random(11)
    while True:
        c = _case(rng, torch.float32, seqs=[(rng.randint(300, 900), 1) for _ in range(40)])
        if c["window"] is None and c["k_cache"].shape[1] > 1:  # (every key seen; two groupings of kv heads)
            break
    batched = _kernel(c)
    alone = dict(c, seqs=c["seqs"][:1], tables=c["tables"][:1], q=c["q"][:1])
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            assert torch.equal(_kernel(alone)[0], batched[0])
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_short_decode_is_bit_identical_read_by_kv_head_or_in_memory_order(cache_dtype):
    """Alone on two threads, a decode of under 129 keys is an item per kv head, read in tiles of keys;
    in a batch its item takes all kv heads and reads each key's slot row in memory order, staging its
    V rows. Same products in the same order: the same bits."""
    rng = random.Random(23)
    while True:
        c = _case(rng, torch.float32, seqs=[(rng.randint(20, 128), 1) for _ in range(40)])
        if c["window"] is None and c["k_cache"].shape[1] > 1 and c["q"].shape[2] % 16 == 0:  # (rows of whole vectors)
            break
    c = dict(c, k_cache=c["k_cache"].to(cache_dtype), v_cache=c["v_cache"].to(cache_dtype))
    batched = _kernel(c)
    alone = dict(c, seqs=c["seqs"][:1], tables=c["tables"][:1], q=c["q"][:1])
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            assert torch.equal(_kernel(alone)[0], batched[0])
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize("seed", range(3))
def test_each_query_of_a_long_prefill_chunk_has_its_decode_bits(dtype, cache_dtype, seed):
    """A long prompt chunk runs in tiles of many query rows (keys in the vector lanes, accumulators
    held across a chunk's keys); every one of its queries decoded alone over the same cached keys
    (one query per sequence, read another way) gets the same bits: a position's result does not
    depend on whether it came in a chunk, a verification pass or a decode, windows and softcaps
    included."""
    rng = random.Random(100 + seed)
    while True:
        c = _case(rng, dtype, seqs=[(rng.randint(400, 700), rng.randint(130, 300))])
        if c["q"].shape[2] % 16 == 0 and c["q"].shape[1] // c["k_cache"].shape[1] > 1:  # (the tile path's shapes)
            break
    c = dict(c, k_cache=c["k_cache"].to(cache_dtype), v_cache=c["v_cache"].to(cache_dtype))
    (ctx, q_len), table = c["seqs"][0], c["tables"][0]
    chunk = _kernel(c)
    decodes = dict(c, seqs=[(ctx - q_len + i + 1, 1) for i in range(q_len)], tables=[table] * q_len)
    assert torch.equal(_kernel(decodes), chunk)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(8))
def test_half_precision_kv_matches_fp64_reference(seed, dtype):
    c = _case(random.Random(1000 + seed), dtype)
    out = _kernel(c)
    assert out.dtype == dtype
    # The kernel accumulates in fp32; the only rounding left is the output's.
    torch.testing.assert_close(out.double(), _reference(c), atol=2e-2, rtol=1e-2)


@needs_kernels
def test_threads_do_not_change_results():
    c = _case(random.Random(7), torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _kernel(c)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, _kernel(c))


@needs_kernels
def test_bad_inputs_raise_clear_errors():
    c = _case(random.Random(3), torch.float32)
    paged = PagedQueries(
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([10**6], dtype=torch.int32),
    )
    out = torch.empty_like(c["q"])
    args = [paged.query_start, paged.query_lens, paged.block_tables, paged.context_lens, c["block"], 1.0, 0, 0.0]
    with pytest.raises(RuntimeError, match="block table"):
        torch.ops.tokenmill.paged_attention(c["q"], c["k_cache"], c["v_cache"], out, *args)
    args[2], args[3] = torch.tensor([[10**6]], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the cache"):  # never a read out of bounds
        torch.ops.tokenmill.paged_attention(c["q"], c["k_cache"], c["v_cache"], out, *args)


def test_kernel_builds_are_per_isa():
    flags = {isa: build.compile_flags(isa) for isa in build.ISA_FLAGS}
    assert "-mavx512f" in flags["avx512"] and "-DCPU_CAPABILITY=AVX512" in flags["avx512"]
    assert "-mavx2" in flags["avx2"] and "-mavx512f" not in flags["avx2"]
    assert not any(f.startswith("-mavx") for f in flags["generic"])
    assert len({build.build_directory(isa) for isa in build.ISA_FLAGS}) == 3


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    assert build.disabled_reason() == "TOKENMILL_CPU_KERNELS=0"
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    assert build.disabled_reason() is None


@pytest.mark.engine
@needs_kernels
def test_engine_with_and_without_the_kernel_matches_hf(sharp_tiny_model_dir, monkeypatch):
    """Decodes and prefill chunks with cached context (chunked prefill, prefix-cache hits) through
    the fused kernel give HF's greedy tokens, and so does the pure-torch fallback."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    shared = mixed_prompts(1, 40, 40, seed=3)[0]
    prompts = mixed_prompts(5, 1, 90, seed=11) + [shared + p for p in mixed_prompts(2, 3, 30, seed=12)]
    expected = hf_greedy_batch(sharp_tiny_model_dir, prompts, greedy.max_tokens)
    for fused in (True, False):
        llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=32)
        runner = llm.engine.runner
        assert runner.fused_attention
        runner.fused_attention = fused
        seen = []

        def recording(*args, seen=seen, **kwargs):
            forward = build_forward(*args, **kwargs)
            seen.append(forward.meta)
            return forward

        monkeypatch.setattr(model_runner, "build_forward", recording)
        llm.generate([shared], greedy)  # fills the prefix cache
        outs = llm.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"fused={fused}"
        assert any(m.paged is not None for m in seen) == fused
        # Chunks with cached context (a later chunk, a prefix-cache hit) went through the kernel too.
        assert any(m.paged is not None and bool((m.paged.query_lens > 1).any()) for m in seen) == fused
        assert any(m.decode_groups for m in seen) != fused


@pytest.mark.slow
@pytest.mark.build
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("isa", sorted(build.ISA_FLAGS))
def test_every_isa_variant_compiles(isa):
    """The machine under the tests runs one variant; the others must still compile (an AVX-512 host
    builds the avx512 one on its first use, an old CPU the generic one)."""
    from torch.utils import cpp_extension

    from tokenmill.kernels.cpu_caps import detect

    if isa == detect().vector_isa and build.load():
        pytest.skip("this machine's variant is built and loaded by the other tests")
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-I", path)]
    checks = {
        source.name: subprocess.Popen(
            ["g++", "-std=c++17", "-w", "-fsyntax-only", *includes, *build.compile_flags(isa), str(source)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source in build.SOURCES
    }  # at once: each parses ATen's headers, ~10 s of one core
    for name, check in checks.items():
        _, stderr = check.communicate(timeout=1800)  # (a hang guard: a machine under load took over 300 s)
        assert check.returncode == 0, f"{name}: {stderr[-3000:]}"


def _int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """What packed_int8_linear computes, in float64 from exact integer sums: x rounded to int16 per
    row and group (x * (32767 / the group's largest magnitude), in fp32, rounded half to even), int32
    sums of x_int16 * q per group, then the sum over groups of float(sum) * x_scale * w_scale."""
    x = x.float().reshape(-1, x.shape[-1])
    rows, k = x.shape
    groups = x.view(rows, k // group, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    xq = torch.round(groups * inv).to(torch.int64)
    sums = torch.einsum("rgk,ngk->rgn", xq, qweight.to(torch.int64).view(-1, k // group, group))
    assert sums.abs().max() < 2**31  # the kernel's int32 sums cannot overflow
    x_scale = (amax / 32767.0).double()  # [rows, groups, 1]
    return (sums.double() * x_scale * scales.double().t()[None]).sum(dim=1)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 15, 16, 40, 700])  # row by row up to 4, register tiles, 2 blocks
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 40), (96, 7), (100, 33), (99, 20), (576, 200)])
def test_int8_linear_is_its_dequantized_weight_times_int16_activations(rows, in_features, out_features):
    """int8 weights times activations rounded to int16 per group (100, 99: one group per row, 99 an
    odd K padded with a zero): the kernel's result is that product to fp32 rounding, within the
    activations' rounding of the exact product with the dequantized weight, and the fallback
    (dequantized weight, no kernel) is the exact product."""
    from tests.utils.linear import int8_linear

    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    kernel, fallback = int8_linear(linear, kernels=True), int8_linear(linear, kernels=False)
    assert torch.equal(kernel.dequantized(torch.float32), fallback.dequantized(torch.float32))  # packing is lossless
    quantized = kernel.quant_method.quantized
    assert all(torch.equal(a, b) for a, b in zip(quantized(kernel), fallback.quant_method.quantized(fallback)))
    x = torch.randn(2, rows, in_features, generator=gen)
    x[0, 0, : in_features // 2] *= 1000  # one row with a far larger first half (its own groups' scales)
    got = kernel(x).double().reshape(-1, out_features)
    q, scales = quantized(kernel)
    weight = kernel.dequantized(torch.float64)
    fp32_rounding = 1e-6 * (x.double().abs().reshape(-1, in_features) @ weight.abs().t()) + 1e-5  # of the sums' terms
    reference = _int8_reference(x, q, scales, kernel.group_size) + linear.bias.double()
    assert bool(((got - reference).abs() <= fp32_rounding).all())
    exact = x.double().reshape(-1, in_features) @ weight.t() + linear.bias.double()
    assert bool(((fallback(x).double().reshape(-1, out_features) - exact).abs() <= fp32_rounding).all())
    # Each input is off by at most half a step of its group's int16 scale; each weight is exact.
    groups = x.double().reshape(-1, in_features // kernel.group_size, kernel.group_size)
    step = (groups.abs().amax(dim=-1, keepdim=True) / 32767).expand_as(groups).reshape(-1, in_features)
    bound = (step / 2) @ weight.abs().t()
    assert bool(((got - exact).abs() <= bound + fp32_rounding).all())
    # Quantization error itself: under half a step of each group's scale per weight.
    err = (kernel.dequantized(torch.float32) - linear.weight).abs()
    step = quantized(kernel)[1].repeat_interleave(kernel.group_size, dim=1)
    assert bool((err <= step / 2 + 1e-6).all())
    assert int8_linear(linear.bfloat16(), True)(x.bfloat16()).dtype == torch.bfloat16  # a bf16 model


@needs_kernels
def test_int8_linear_passes_non_finite_activations_on():
    """An inf or NaN activation is not rounded away: its rows come out non-finite, as in fp32."""
    from tests.utils.linear import int8_linear

    layer = int8_linear(torch.nn.Linear(64, 20), kernels=True)
    x = torch.randn(3, 64)
    x[0, 5], x[1, 40] = float("inf"), float("nan")
    out = layer(x)
    assert not out[0].isfinite().any() and not out[1].isfinite().any() and out[2].isfinite().all()


@needs_kernels
def test_int8_linear_rows_do_not_depend_on_their_batch():
    from tests.utils.linear import int8_linear

    layer = int8_linear(torch.nn.Linear(96, 70), kernels=True)
    batch = torch.randn(131, 96)
    alone = torch.cat([layer(row[None]) for row in batch])
    for size in (2, 4, 5, 7, 64, 131):
        assert torch.equal(layer(batch[:size]), alone[:size]), size


def _int8_layer(in_features: int, out_features: int, bias: bool, seed: int):
    from tests.utils.linear import int8_linear

    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return int8_linear(linear, kernels=True), gen


@needs_kernels
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(64, 40, True), (576, 1536, False), (1536, 200, True), (32, 33, False)]
)
def test_int8_steps_on_amx_int8_tiles_equal_the_panels(in_features, out_features, bias):
    """fp32 x of 16 rows and more goes to AMX-int8 tiles where the CPU has them (int16 inputs split
    into high and low bytes): every row's bits are the panel path's for that row alone."""
    if not torch.ops.tokenmill.amx_int8_usable():
        pytest.skip("needs a CPU with AMX-int8 (and tokenmill's AVX-512 kernels)")
    layer, gen = _int8_layer(in_features, out_features, bias, seed=in_features + out_features)
    batch = torch.randn(300, in_features, generator=gen)
    batch[3, : in_features // 2] *= 1000  # one row with far larger groups
    alone = torch.cat([layer(row[None]) for row in batch])
    for size in (16, 17, 33, 64, 300):
        assert torch.equal(layer(batch[:size]), alone[:size]), size


@needs_kernels
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(64, 40, True), (576, 1536, False), (1536, 200, True)]
)
def test_bf16_int8_steps_on_amx_tiles_are_x_times_the_bf16_rounded_weights(in_features, out_features, bias):
    """bf16 x of 16 rows and more (a bf16 model's batches and prefill chunks) on AMX-bf16 tiles: x
    times the weights rounded once to bf16 (q * scale), summed in fp32 (from 1,024 rows by oneDNN's
    GEMM over the same bf16 weights), rounded to bf16: within half a bf16 step of that product."""
    if not torch.ops.tokenmill.amx_bf16_usable():
        pytest.skip("needs a CPU with AMX-bf16 (and tokenmill's AVX-512 kernels)")
    layer, gen = _int8_layer(in_features, out_features, bias, seed=in_features * out_features)
    weight = layer.dequantized(torch.float32).bfloat16().double()
    for size in (16, 40, 300, 1024, 1100):
        x = torch.randn(size, in_features, generator=gen).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16
        exact = x.double() @ weight.t() + (layer.bias.double() if bias else 0.0)
        fp32_sums = 1e-6 * (x.double().abs() @ weight.abs().t()) + 1e-6
        assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + fp32_sums).all()), size


@needs_kernels
def test_int8_weights_share_one_buffer():
    """--quantization int8 moves every layer's packed int8 weight and scales into one (huge-page)
    buffer, as for fp32 panels; results are those of the layers before the move."""
    from tests.utils.linear import int8_linear, prepare

    model = torch.nn.Sequential(torch.nn.Linear(96, 50), torch.nn.SiLU(), torch.nn.Linear(50, 70, bias=False))
    x = torch.randn(3, 96)
    with torch.inference_mode():
        apart = [int8_linear(model[i], kernels=True) for i in (0, 2)]
        expected = apart[1](torch.nn.functional.silu(apart[0](x)))
        prepare(model, quantization="int8")
        layers = [model[0], model[2]]
        tensors = [t for layer in layers for t in (layer.qweight, layer.scales)]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        for layer, alone in zip(layers, apart):
            assert torch.equal(layer.qweight, alone.qweight) and torch.equal(layer.scales, alone.scales)
        assert torch.equal(model(x), expected)


@needs_kernels
def test_int8_linear_rejects_bad_shapes():
    q = torch.ops.tokenmill.pack_int8_weight(torch.zeros(8, 64, dtype=torch.int8))
    scales = torch.ops.tokenmill.pack_linear_weight(torch.ones(8, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K, N"):
        torch.ops.tokenmill.packed_int8_linear(torch.zeros(1, 32), q, scales, None, 8)
    with pytest.raises(RuntimeError, match="groups dividing K"):
        torch.ops.tokenmill.packed_int8_linear(
            torch.zeros(1, 64),
            q,
            torch.ops.tokenmill.pack_linear_weight(torch.ones(8, 3, dtype=torch.bfloat16)),
            None,
            8,
        )
    with pytest.raises(RuntimeError, match="bf16 or fp16 scales"):  # (fp32 ones are not taken)
        torch.ops.tokenmill.packed_int8_linear(
            torch.zeros(1, 64), q, torch.ops.tokenmill.pack_linear_weight(torch.ones(8, 2)), None, 8
        )
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.tokenmill.packed_int8_linear(torch.zeros(1, 64), q, scales, torch.zeros(7), 8)
    with pytest.raises(RuntimeError, match="int8 weight"):
        torch.ops.tokenmill.packed_int8_linear(torch.zeros(1, 64), scales, scales, None, 8)
    with pytest.raises(RuntimeError, match="groups dividing K"):  # odd groups: pairs of inputs would span two
        torch.ops.tokenmill.packed_int8_linear(
            torch.zeros(1, 66),
            torch.ops.tokenmill.pack_int8_weight(torch.zeros(8, 66, dtype=torch.int8)),
            torch.ops.tokenmill.pack_linear_weight(torch.ones(8, 2, dtype=torch.bfloat16)),
            None,
            8,
        )
    with pytest.raises(RuntimeError, match="pack_int8_weight"):
        torch.ops.tokenmill.pack_linear_weight(torch.zeros(8, 64, dtype=torch.int8))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64, 250])  # register tiles of 6 (AVX2) / 12 rows, blocks
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 40), (100, 7), (576, 1031), (1536, 64)])
def test_packed_linear_matches_a_float64_product(rows, in_features, out_features):
    """The panel GEMM: N off the panel width (a partial last panel), K any length, bias or none,
    1-250 rows (several row blocks at K=1536), a strided x."""
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = torch.ops.tokenmill.pack_linear_weight(weight)
    expected = x.double() @ weight.double().t()
    out = torch.ops.tokenmill.packed_linear(x, packed, None, out_features)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
    out = torch.ops.tokenmill.packed_linear(x, packed, bias, out_features)
    torch.testing.assert_close(out.double(), expected + bias.double(), atol=1e-4, rtol=1e-5)
    wide = torch.randn(rows, 2 * in_features, generator=gen)
    torch.testing.assert_close(
        torch.ops.tokenmill.packed_linear(wide[:, ::2], packed, None, out_features),
        wide[:, ::2] @ weight.t(),
        atol=1e-4,
        rtol=1e-5,
    )


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 40), (576, 1031)])
def test_bf16_panels_compute_on_their_exact_fp32_values(rows, in_features, out_features):
    """bf16 weights (a bf16 model on a CPU without native bf16) are widened exactly as they stream:
    the result is the fp32 kernel's on the same values, bit for bit, returned in x's dtype (bf16
    activations are taken to fp32 first, like oneDNN's bf16 GEMM accumulates in fp32)."""
    gen = torch.Generator().manual_seed(rows + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    packed = torch.ops.tokenmill.pack_linear_weight(weight)
    assert packed.dtype == torch.bfloat16
    as_fp32 = torch.ops.tokenmill.pack_linear_weight(weight.float())
    out = torch.ops.tokenmill.packed_linear(x.bfloat16(), packed, bias, out_features)
    assert out.dtype == torch.bfloat16
    exact = torch.ops.tokenmill.packed_linear(x.bfloat16().float(), as_fp32, bias.float(), out_features)
    assert torch.equal(out, exact.bfloat16())
    assert torch.equal(
        torch.ops.tokenmill.packed_linear(x, packed, None, out_features),
        torch.ops.tokenmill.packed_linear(x, as_fp32, None, out_features),
    )
    expected = x.bfloat16().double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(out.double(), expected, atol=0.1, rtol=1e-2)  # (bf16 output rounding)
    with pytest.raises(RuntimeError, match="bias of x's dtype"):
        torch.ops.tokenmill.packed_linear(x, packed, bias, out_features)


@needs_kernels
def test_packed_linear_rows_do_not_depend_on_their_batch():
    """A row's outputs are bit-identical whether it runs alone or in any position of a batch of any
    size (one accumulation order for every register tile): other requests never change a result."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(200, 320, generator=gen), torch.randn(200, generator=gen)
    packed = torch.ops.tokenmill.pack_linear_weight(weight)
    batch = torch.randn(131, 320, generator=gen)
    alone = torch.cat([torch.ops.tokenmill.packed_linear(row[None], packed, bias, 200) for row in batch])
    for rows in (2, 5, 6, 7, 64, 131):
        assert torch.equal(torch.ops.tokenmill.packed_linear(batch[:rows], packed, bias, 200), alone[:rows]), rows
    assert torch.equal(torch.ops.tokenmill.packed_linear(batch[3:50], packed, bias, 200), alone[3:50])


@needs_kernels
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_a_vocabulary_sized_matrix_taken_piece_by_piece_gives_each_column_its_own_result(kind):
    """A matrix of 512 panels or more (a vocabulary projection) is shared among the threads piece
    by piece as they finish: each column's result is bit-identical to the same column's in a small
    matrix (split by halves), for one row, a few, one block of rows and several blocks."""
    from tests.utils.linear import int8_linear

    gen = torch.Generator().manual_seed(11)
    n, k = 8200, 96  # 513 panels, the last one partial
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(700, k, generator=gen)

    def layer(rows: slice):
        linear = torch.nn.Linear(k, rows.stop - rows.start)
        with torch.no_grad():
            linear.weight.copy_(weight[rows]), linear.bias.copy_(bias[rows])
        if kind == "int8":
            return int8_linear(linear, kernels=True)
        packed = torch.ops.tokenmill.pack_linear_weight(
            linear.weight.detach().to(torch.bfloat16 if kind == "bf16" else torch.float32)
        )
        return lambda rows_of_x: torch.ops.tokenmill.packed_linear(rows_of_x, packed, linear.bias, linear.out_features)

    whole = layer(slice(0, n))
    for columns in (slice(0, 160), slice(4000, 4160), slice(8040, 8200)):
        part = layer(columns)
        for rows in (1, 3, 7, 40, 700):  # 700: several blocks of rows, shared by halves
            assert torch.equal(whole(x[:rows])[:, columns], part(x[:rows])), (kind, columns, rows)


@needs_kernels
def test_packed_linear_rejects_bad_inputs():
    packed = torch.ops.tokenmill.pack_linear_weight(torch.zeros(40, 64))
    with pytest.raises(RuntimeError, match="pack_linear_weight"):  # another K
        torch.ops.tokenmill.packed_linear(torch.zeros(1, 32), packed, None, 40)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):  # an N the panels do not hold
        torch.ops.tokenmill.packed_linear(torch.zeros(1, 64), packed, None, 200)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):  # not a packed weight
        torch.ops.tokenmill.packed_linear(torch.zeros(1, 64), torch.zeros(40, 64), None, 40)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.tokenmill.packed_linear(torch.zeros(1, 64).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.tokenmill.packed_linear(torch.zeros(1, 64), packed, torch.zeros(39), 40)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.tokenmill.pack_linear_weight(torch.zeros(40, 64).half())


@pytest.mark.parametrize("native_bf16", [True, False])
def test_packing_puts_bf16_on_panels_only_without_native_bf16(monkeypatch, native_bf16):
    """bf16 linears go to the panel GEMM where the CPU has no native bf16 (AMX / AVX512-BF16; torch's
    bf16 GEMMs are slow there), to oneDNN where it has; the tied embedding reads bf16 panels too."""
    from tests.utils.linear import prepare
    from tokenmill.kernels.cpu_caps import CpuCaps
    from tokenmill.models.layers import packed_linear

    if not build.load():
        pytest.skip("kernels off")
    caps = packed_linear.detect()
    monkeypatch.setattr(
        packed_linear,
        "detect",
        lambda: CpuCaps(**{**caps.__dict__, "avx512_bf16": native_bf16, "amx_bf16": native_bf16}),
    )
    expect_panels = not native_bf16
    if not expect_panels and packed_linear.packed_method_for(torch.bfloat16) is None:
        pytest.skip("no oneDNN bf16 here")
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(300, 64).bfloat16()
    model.head = torch.nn.Linear(64, 300, bias=False).bfloat16()
    model.head.weight = model.embed.weight
    model.proj = torch.nn.Linear(64, 64).bfloat16()
    x, ids = torch.randn(3, 64).bfloat16(), torch.tensor([0, 17, 299])
    with torch.inference_mode():
        expected = (model.head(x), model.proj(x), model.embed(ids))
        prepare(model)
        assert {model.head.quant_method.name, model.proj.quant_method.name} == {"panels" if expect_panels else "onednn"}
        got = (model.head(x), model.proj(x), model.embed(ids))
        for g, e in zip(got, expected):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.float(), e.float(), atol=0.05, rtol=2e-2)
        assert torch.equal(got[2], expected[2])  # embedding rows exactly, from the panels when packed
        assert isinstance(model.embed, packed_linear.PanelEmbedding) == expect_panels


@pytest.mark.parametrize("kernels", [True, False])
def test_packing_picks_the_panel_kernel_for_fp32(monkeypatch, kernels):
    """fp32 linears go to the panel GEMM when tokenmill's kernels load, to oneDNN when they cannot;
    either gives nn.Linear's result, for 2-D and 3-D inputs, with and without a bias."""
    from tests.utils.linear import prepare
    from tokenmill.models.layers import packed_linear

    if kernels and not build.load():
        pytest.skip("kernels off")
    monkeypatch.setattr(packed_linear.build, "load", lambda: kernels)
    model = torch.nn.Sequential(torch.nn.Linear(96, 50), torch.nn.SiLU(), torch.nn.Linear(50, 70, bias=False))
    x = torch.randn(2, 9, 96)
    with torch.inference_mode():
        expected = model(x)
        prepare(model)
        kinds = {m.quant_method.name for m in model if not isinstance(m, torch.nn.SiLU)}
        assert kinds == {"panels" if kernels else "onednn"}
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(model(x[0]), expected[0], atol=1e-4, rtol=1e-5)


def test_tied_embedding_reads_the_packed_head():
    """An embedding tied to a panel-packed head looks rows up in the head's panels (every panel
    position, the partial last panel, any id shape) and drops its own copy; untied ones stay."""
    from tests.utils.linear import prepare
    from tokenmill.models.layers.packed_linear import PanelEmbedding

    if not build.load():
        pytest.skip("kernels off")
    model = torch.nn.Module()
    model.embed, model.untied = torch.nn.Embedding(1003, 72, padding_idx=0), torch.nn.Embedding(1003, 72)
    model.head = torch.nn.Linear(72, 1003, bias=False)
    model.head.weight = model.embed.weight
    table = model.embed.weight.detach().clone()
    with torch.inference_mode():
        prepare(model)
        assert isinstance(model.embed, PanelEmbedding) and type(model.untied) is torch.nn.Embedding
        assert [name for name, _ in model.named_parameters()] == ["untied.weight"]
        ids = torch.tensor([[0, 1, 15, 16, 17, 31, 32, 1000, 1002], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
        assert torch.equal(model.embed(ids), table[ids])
        assert torch.equal(model.embed(ids[0, 3]), table[ids[0, 3]])
        assert model.embed.panels.data_ptr() == model.head.packed_weight.data_ptr()  # one copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,dim", [(300, 64), (1000, 99)])
def test_int8_head_keeps_one_copy_for_a_tied_embedding(vocab, dim, dtype):
    """--quantization int8 quantizes the lm_head too (tokenmill's kernels), and the embedding tied to
    it reads its rows from the packed int8 head: one copy of the table, rows equal to the head's
    dequantized rows in the model's dtype (dim 99: one group per row, odd inputs padded in the
    packed pairs); an id outside the table is refused, never read."""
    from tests.utils.linear import prepare
    from tokenmill.models.layers.quantization.int8 import Int8Embedding

    if not build.load():
        pytest.skip("tokenmill's CPU kernels are not available")
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(vocab, dim)
    model.lm_head = torch.nn.Linear(dim, vocab, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    model.to(dtype)
    table = model.embed_tokens.weight.detach().float().clone()
    with torch.inference_mode():
        prepare(model, quantization="int8")
        head, embedding = model.lm_head, model.embed_tokens
        assert head.quant_method.name == "int8" and isinstance(embedding, Int8Embedding)
        assert [name for name, _ in model.named_parameters()] == []
        assert [t.data_ptr() for t in head.quant_method.streamed_tensors(head)] == [
            head.qweight.data_ptr(),
            head.scales.data_ptr(),
        ]
        dequantized = head.dequantized(dtype)
        ids = torch.tensor([[0, 15], [16, vocab - 1]])
        rows = embedding(ids)
        assert rows.shape == (2, 2, dim) and rows.dtype == dtype
        assert torch.equal(rows, dequantized[ids])
        assert torch.equal(embedding(torch.arange(vocab)), dequantized)
        with pytest.raises(RuntimeError, match="outside"):
            embedding(torch.tensor([vocab + 40]))
        dequantized = head.dequantized(torch.float32)
        # (each group's scale is a bf16 value from its largest magnitude / 127, rounded up, to twice
        # that (the least-error one: tests/kernels/test_int8_scales.py), and its int8 rows are the table's to
        # within half that step)
        exact = (
            table.abs().amax(dim=1, keepdim=True) / 127
            if dim % 32
            else table.view(vocab, -1, 32).abs().amax(dim=-1) / 127
        )
        scales = head.quant_method.quantized(head)[1].float()
        assert head.quant_method.quantized(head)[1].dtype == torch.bfloat16
        assert (scales >= exact).all() and (scales <= 2 * exact * (1 + 2**-7)).all()
        step = scales.repeat_interleave(dim // scales.shape[1], dim=1)
        assert ((dequantized - table).abs() <= step / 2 + 1e-6).all()


def test_vocab_projection_paths_agree(monkeypatch):
    """A plain CPU head (vocab-major product or F.linear) and a packed one give the same logits."""
    from tests.utils.linear import prepare
    from tokenmill.models.layers import linear

    head = torch.nn.Linear(96, 1000, bias=False)
    plain = linear.Linear.from_linear(head)
    holder = torch.nn.Module()
    holder.head = torch.nn.Linear(96, 1000, bias=False)
    holder.head.load_state_dict(head.state_dict())
    prepare(holder)
    for rows in (1, 9, 33):
        hidden = torch.randn(rows, 96)
        results = {}
        for mode in ("auto", "linear"):
            monkeypatch.setattr(linear, "_LM_HEAD_MODE", mode)
            results[mode] = plain.logits(hidden)
        results["packed"] = holder.head.logits(hidden)
        for got in results.values():
            torch.testing.assert_close(got, head(hidden), atol=1e-4, rtol=1e-5)


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """No compiler (or a broken one): load() says why and returns False; nothing half-built is kept."""

    def no_compiler(name, isa, directory):
        raise RuntimeError("Error building extension 'tokenmill_cpu': g++: command not found")

    monkeypatch.setattr(build, "_compile", no_compiler)
    monkeypatch.setattr(build, "build_directory", lambda isa: tmp_path / isa)
    with caplog.at_level("WARNING", logger="tokenmill.kernels.build"):
        assert build.load.__wrapped__() is False
    assert "could not be built or loaded" in caplog.text and "g++: command not found" in caplog.text
    assert not any(tmp_path.rglob(build._DONE_MARKER))


@needs_kernels
@pytest.mark.parametrize("seed", range(6))
def test_lora_delta_kernel_matches_per_row_reference(seed):
    """`lora_delta` adds B_s (A_s x) to each grouped row's output, reading only each slot's blocks
    (true rank, own part of a fused layer, or one whole-layer block): random layer shapes (feature
    counts off the vector width), parts, ranks under the slot width, empty slots and groups of 1-22
    rows, against the per-row product of the same matrices."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    in_features = rng.choice([7, 64, 100, 576])
    part_sizes = [rng.choice([5, 16, 33, 96]) for _ in range(rng.randint(1, 3))]
    width, slots, tokens = rng.choice([4, 8, 16]), 4, 90
    out_features = sum(part_sizes)
    lora_a = torch.zeros(slots, len(part_sizes) * width, in_features)
    lora_b = torch.zeros(slots, len(part_sizes) * width, out_features)
    blocks = torch.zeros(slots, len(part_sizes), 4, dtype=torch.long)
    for slot in range(1, slots):  # slot 0 stays empty (an adapter that does not target the layer)
        whole = slot == 3  # a whole-layer adapter of a fused layer: one block over every feature
        spans = (
            [(0, out_features)]
            if whole
            else [(sum(part_sizes[:p]), sum(part_sizes[: p + 1])) for p in range(len(part_sizes))]
        )
        for part, (first, end) in enumerate(spans):
            rank, col = rng.randint(1, width), part * width
            lora_a[slot, col : col + rank] = torch.randn(rank, in_features, generator=gen)
            lora_b[slot, col : col + rank, first:end] = torch.randn(rank, end - first, generator=gen)
            blocks[slot, part] = torch.tensor([col, rank, first, end])
    x, base = torch.randn(tokens, in_features, generator=gen), torch.randn(tokens, out_features, generator=gen)
    order = torch.randperm(tokens, generator=gen).tolist()
    rows, segments = [], []
    for slot in range(slots):
        count = rng.randint(1, 22) if slot or rng.random() < 0.5 else 0  # (4 x 22 <= tokens)
        segments.append((slot, len(rows), len(rows) + count))
        rows += order[len(rows) : len(rows) + count]
    segments = [s for s in segments if s[2] > s[1]]
    expected = base.clone()
    for slot, start, end in segments:
        for row in rows[start:end]:
            expected[row] += (lora_a[slot] @ x[row]) @ lora_b[slot]
    out = base.clone()
    torch.ops.tokenmill.lora_delta(x, out, lora_a, lora_b, torch.tensor(rows), torch.tensor(segments), blocks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    untouched = sorted(set(range(tokens)) - set(rows))
    assert torch.equal(out[untouched], base[untouched])  # rows without an adapter are left as they were


@needs_kernels
@pytest.mark.parametrize("dim", [7, 64, 576, 1000])
def test_fused_rms_norm_and_silu_mul_match_the_unfused_ops(dim):
    """The fused RMSNorm and SiLU(gate) * up kernels against the ops they replace (transformers' op
    order), on row sizes on and off the vector width."""
    from transformers.activations import ACT2FN

    from tokenmill.models.families.llama import rms_normalize

    gen = torch.Generator().manual_seed(dim)
    x, weight = torch.randn(5, 3, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    torch.testing.assert_close(
        torch.ops.tokenmill.rms_norm(x, weight, 1e-6), weight * rms_normalize(x, 1e-6), rtol=2e-6, atol=2e-6
    )
    gate_up = torch.randn(9, 2 * dim, generator=gen) * 4
    gate, up = gate_up.split(dim, dim=-1)
    torch.testing.assert_close(torch.ops.tokenmill.silu_mul(gate_up), ACT2FN["silu"](gate) * up, rtol=2e-6, atol=2e-6)


@needs_kernels
@pytest.mark.parametrize(("head_dim", "rotary"), [(64, 64), (96, 48), (8, 8), (40, 20)])
def test_fused_rope_rotates_q_and_k_in_place_like_apply_rope(head_dim, rotary):
    """RoPE in place on q/k views of a fused qkv projection (strided rows), full and partial rotary
    dims (Phi-3), against apply_rope."""
    from tokenmill.models.families.llama import apply_rope

    gen = torch.Generator().manual_seed(head_dim + rotary)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, 1, rotary // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.ops.tokenmill.rope_(q, k, cos.view(tokens, -1), sin.view(tokens, -1))
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, expected_k, rtol=1e-6, atol=1e-6)


@needs_kernels
def test_bf16_silu_mul_gives_the_bf16_ops_bits_for_every_bf16_gate():
    """bf16 SiLU(gate) * up takes a faster exp than fp32's (ATen's exp_u20, ~25% of a prefill's
    SiLU*up time): its few ulps of fp32 never reach the bf16 rounding, checked for every finite bf16
    gate value (and ups of both signs, so the product rounds too), rows on and off the vector width."""
    from transformers.activations import ACT2FN

    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = bits[torch.isfinite(bits.float())]
    for width in (16, 7):
        gate = gates[: gates.numel() - gates.numel() % width].view(-1, width)
        for up_value in (1.0, -3.25):
            up = torch.full_like(gate, up_value)
            got = torch.ops.tokenmill.silu_mul(torch.cat([gate, up], dim=1))
            assert torch.equal(got, ACT2FN["silu"](gate) * up)


@needs_kernels
@pytest.mark.parametrize("dim", [7, 64, 576])
def test_bf16_elementwise_kernels_round_where_the_bf16_ops_round(dim):
    """bf16 rows through the fused kernels: computed in fp32 and rounded to bf16 where each unfused
    bf16 op rounds, so SiLU(gate) * up and RoPE give the unfused ops' bits, and RMSNorm differs at
    most by the summation order of its mean (an ulp of bf16, rarely)."""
    from transformers.activations import ACT2FN

    from tokenmill.models.families.llama import apply_rope, rms_normalize

    gen = torch.Generator().manual_seed(dim)
    bf16 = torch.bfloat16
    gate_up = (torch.randn(9, 2 * dim, generator=gen) * 4).to(bf16)
    gate, up = gate_up.split(dim, dim=-1)
    assert torch.equal(torch.ops.tokenmill.silu_mul(gate_up), ACT2FN["silu"](gate) * up)
    tokens, heads, head_dim = 5, 3, 2 * dim
    q, k = (torch.randn(tokens, n, head_dim, generator=gen).to(bf16) for n in (heads, 1))
    angles = torch.rand(tokens, 1, dim, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(bf16) for f in (torch.cos, torch.sin))
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.ops.tokenmill.rope_(q, k, cos.view(tokens, -1), sin.view(tokens, -1))
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    x, weight = (torch.randn(7, dim, generator=gen) * 3).to(bf16), torch.randn(dim, generator=gen).to(bf16)
    fused, unfused = torch.ops.tokenmill.rms_norm(x, weight, 1e-6), weight * rms_normalize(x, 1e-6).to(bf16)
    assert fused.dtype == bf16
    torch.testing.assert_close(fused, unfused, rtol=2**-7, atol=0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tokenmill.rms_norm(x, weight.float(), 1e-6)  # one dtype for all


@needs_kernels
def test_the_cpp_onednn_projection_pads_rows_as_the_python_one():
    """oneDNN builds a primitive per row count, so both projections pad to the same few buckets."""
    from tokenmill.models.layers.packed_linear import padded_rows

    assert [torch.ops.tokenmill.onednn_padded_rows(n) for n in range(1, 3000)] == [
        padded_rows(n) for n in range(1, 3000)
    ]


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_fp32_queries_over_a_narrower_kv_cache(seed, cache_dtype):
    """--kv-cache-dtype under an fp32 model: the kernel reads bf16/fp16 K/V and computes in fp32,
    exactly the attention of fp32 queries over the rounded K/V."""
    c = _case(random.Random(2000 + seed), torch.float32)
    c["k_cache"], c["v_cache"] = c["k_cache"].to(cache_dtype), c["v_cache"].to(cache_dtype)
    _assert_fp32_kernel_matches_reference(c)


@pytest.mark.engine
@needs_kernels
@pytest.mark.parametrize("kv_dtype, blocks_vs_fp32", [(torch.bfloat16, 1.99), (torch.int8, 3.5)])
def test_narrow_kv_cache_engine_kernel_and_fallback_agree(sharp_tiny_model_dir, kv_dtype, blocks_vs_fp32):
    """An fp32 model over a bf16 cache (half the bytes per block) or an int8 one (68 bytes per 64-wide
    row instead of 256): more blocks in one budget; the kernel and the pure-torch fallback read the
    same rounded or quantized K/V and give the same greedy tokens (chunked prefill with cached
    context, decodes); the narrowing is real: the tokens are not all those of the fp32 cache, though
    most first tokens are."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = mixed_prompts(6, 1, 90, seed=21)
    name = str(kv_dtype).removeprefix("torch.")
    tokens, blocks = {}, {}
    for choice, fused in ((name, True), (name, False), ("auto", True)):
        llm = LLM(
            str(sharp_tiny_model_dir),
            progress=False,
            kv_cache_memory="32MiB",
            max_num_batched_tokens=32,
            dtype="float32",
            kv_cache_dtype=choice,
            # (the fallback attends a prompt's first chunk by SDPA over its fresh K/V; batch invariance
            # would put it on the kernel, reading it back narrowed from the cache)
            batch_invariant=False,
        )
        llm.engine.runner.fused_attention = fused
        assert llm.engine.kv_cache.data.dtype == (kv_dtype if choice == name else torch.float32)
        blocks[choice] = llm.engine.allocator.num_blocks
        tokens[(choice, fused)] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert tokens[(name, True)] == tokens[(name, False)]
    assert tokens[(name, True)] != tokens[("auto", True)]  # (several of the 6 differ: sharp random weights)
    assert sum(a[0] == b[0] for a, b in zip(tokens[(name, True)], tokens[("auto", True)])) >= 4
    assert blocks[name] >= blocks_vs_fp32 * blocks["auto"]


@pytest.mark.engine
def test_a_kv_cache_wider_than_the_model_is_refused(sharp_tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 is wider"):
        LLM(str(sharp_tiny_model_dir), progress=False, dtype="bfloat16", kv_cache_dtype="float32")


def _int8_cache(cache: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An fp32 test cache as an int8 one: the rows a sequence owns quantized, the others random bytes
    with a NaN scale (read, they poison the output as the fp32 cache's NaNs do)."""
    owned = ~cache.isnan().any(-1)
    out = torch.randint(-128, 128, (*cache.shape[:-1], cache.shape[-1] + 4), generator=gen, dtype=torch.int8)
    out[..., -4:] = torch.full(cache.shape[:-1] + (1,), float("nan")).view(torch.int8)
    out[owned] = to_cache(cache[owned], torch.int8)
    return out


@needs_kernels
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_int8_kv_cache_matches_attention_over_its_dequantized_rows(seed, q_dtype):
    """--kv-cache-dtype int8: the kernel reads each row's int8 values and fp32 scale in place; the
    result is the attention over the dequantized K/V (any head size, GQA, window, softcap)."""
    c = _case(random.Random(3000 + seed), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    c["k_cache"], c["v_cache"] = _int8_cache(c["k_cache"], gen), _int8_cache(c["v_cache"], gen)
    c["q"] = c["q"].to(q_dtype)
    out = _kernel(c)
    assert out.dtype == q_dtype and not out.isnan().any()
    dequantized = dict(
        c, k_cache=from_cache(c["k_cache"], torch.float64), v_cache=from_cache(c["v_cache"], torch.float64)
    )
    tolerance = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), _reference(dequantized), atol=tolerance, rtol=tolerance)


def test_int8_cache_rows_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 40, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    x[7, 1] = 0  # an all-zero row keeps a usable (tiny) scale and comes back as zeros
    rows = to_cache(x, torch.int8)
    assert rows.shape == (50, 3, 44) and rows.dtype == torch.int8
    step = x.abs().amax(-1, keepdim=True) / 127
    back = from_cache(rows, torch.float32)
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[7, 1], torch.zeros(40))
    assert (back.abs().amax(-1) - x.abs().amax(-1)).abs().max() < 1e-5  # absmax maps to +-127 exactly


def _amx_applies(k: int = 64) -> bool:
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, k, dtype=torch.bfloat16), 64)
    return torch.ops.tokenmill.amx_linear_applies(torch.ones(1, k, dtype=torch.bfloat16), weight)


needs_amx = pytest.mark.skipif(
    not (build.load() and torch.ops.mkldnn._is_mkldnn_bf16_supported() and _amx_applies()),
    reason="no AMX here (or an AVX2 build of the kernels)",
)


@needs_kernels
def test_the_cpp_onednn_reorder_expects_the_python_batch_hint():
    """amx_linear checks oneDNN's layout by reordering probes with the hint the weights were reordered with."""
    from tokenmill.models.layers.packed_linear import _BATCH_HINT

    assert torch.ops.tokenmill.onednn_batch_hint() == _BATCH_HINT


@needs_amx
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (100, 70), (33, 64), (33, 40)])
def test_amx_linear_gives_onednns_bits_at_decode_sizes(out_features, in_features):
    """Decode-sized bf16 steps on AMX read oneDNN's reordered weight with tokenmill's tiles: up to 32
    rows the same sums in the same order, so the same bits as oneDNN's GEMM (and both close to fp32's
    product), with and without a bias, for shapes that are not whole tiles; 33-64 rows are chunks of
    32 (each row's bits whatever the step's row count; oneDNN blocks them otherwise: close); larger
    steps stay on oneDNN. (Under 64 inputs oneDNN sums some rows in another order: an ulp apart.)"""
    gen = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    assert torch.ops.tokenmill.onednn_amx_layout(out_features, in_features)
    for rows in (1, 2, 7, 16, 17, 31, 32, 33, 48, 63, 64):  # (past 32: chunks of 32 rows, the last padded)
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        assert torch.ops.tokenmill.amx_linear_applies(x, packed)
        for b in (None, bias):
            got = torch.ops.tokenmill.amx_linear(x, packed, b)
            onednn = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            exact = x.float() @ weight.float().T + (0 if b is None else b.float())
            tolerance = {"rtol": 2**-7, "atol": 2**-7 * exact.abs().max().item()}
            if rows > 32:  # (oneDNN's own blocking changes past 32 rows; ours is the same for every row count)
                parts = [
                    torch.ops.tokenmill.amx_linear(x[:32], packed, b),
                    torch.ops.tokenmill.amx_linear(x[32:], packed, b),
                ]
                assert torch.equal(got, torch.cat(parts))
                torch.testing.assert_close(got, onednn, **tolerance)
            elif b is None and in_features >= 64:
                assert torch.equal(got, onednn)
            else:  # (oneDNN adds some blocks' bias before the last rounding of the sums: an ulp apart at times)
                torch.testing.assert_close(got, onednn, **tolerance)
            assert torch.equal(torch.ops.tokenmill.onednn_linear(x, packed, b), got)
            torch.testing.assert_close(got.float(), exact, **tolerance)
    assert not torch.ops.tokenmill.amx_linear_applies(torch.ones(65, in_features, dtype=torch.bfloat16), packed)


@needs_amx
def test_amx_linear_refuses_what_it_cannot_read():
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 64, dtype=torch.bfloat16), 64)
    for x in (torch.ones(1, 64), torch.ones(65, 64, dtype=torch.bfloat16), torch.ones(1, 32, dtype=torch.bfloat16)):
        assert not torch.ops.tokenmill.amx_linear_applies(x, packed)
        with pytest.raises(RuntimeError, match="amx_linear: bf16 x"):
            torch.ops.tokenmill.amx_linear(x, packed, None)


@needs_amx
@pytest.mark.parametrize("out_features, in_features", [(1000, 576), (100, 70)])
def test_amx_logits_are_amx_linears_sums_unrounded(out_features, in_features):
    """A bf16 head's logits on AMX: the tiles' fp32 sums as amx_linear rounds them to bf16 (the same
    bits once rounded), for any row count (past 64: every 32-row chunk the same as alone), with a
    bias, and within fp32 summation of the exact product."""
    gen = torch.Generator().manual_seed(in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    for rows in (1, 17, 32, 48, 64, 100):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        assert torch.ops.tokenmill.amx_logits_applies(x, packed)
        for b in (None, bias):
            logits = torch.ops.tokenmill.amx_logits(x, packed, b)
            assert logits.dtype == torch.float32 and logits.shape == (rows, out_features)
            exact = x.double() @ weight.double().T + (0 if b is None else b.double())
            torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=1e-5)
            assert (logits != logits.to(torch.bfloat16).float()).any()  # not rounded to bf16
            if rows <= 64:
                assert torch.equal(logits.to(torch.bfloat16), torch.ops.tokenmill.amx_linear(x, packed, b))
            else:
                assert torch.equal(logits[64:], torch.ops.tokenmill.amx_logits(x[64:], packed, b))
    with pytest.raises(RuntimeError, match="amx_logits: bf16 x"):
        torch.ops.tokenmill.amx_logits(torch.ones(2, in_features), packed, None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_and_panel_logits_are_the_linears_sums_unrounded(dtype):
    """An int8 head's and a panel head's logits: the fp32 sums packed_int8_linear / packed_linear round
    to x's dtype (the same bits once rounded; equal for fp32 x), at sizes that take the panels, the
    AMX-int8 or AMX-bf16 tiles where the CPU has them, and the int8 head's dense prefill size."""
    from tokenmill.models.layers.quantization.int8 import quantize_weight

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 96, generator=gen) / 10
    qweight, scales = quantize_weight(weight, 32)
    q8 = torch.ops.tokenmill.pack_int8_weight(qweight)
    s8 = torch.ops.tokenmill.pack_linear_weight(scales)
    panels = torch.ops.tokenmill.pack_linear_weight(weight.to(dtype))
    for rows in (1, 5, 12, 16, 40, 1024):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        pairs = [
            (
                torch.ops.tokenmill.packed_int8_logits(x, q8, s8, None, 200),
                torch.ops.tokenmill.packed_int8_linear(x, q8, s8, None, 200),
            )
        ]
        if rows < 1024:
            pairs.append(
                (
                    torch.ops.tokenmill.packed_logits(x, panels, None, 200),
                    torch.ops.tokenmill.packed_linear(x, panels, None, 200),
                )
            )
        for logits, linear in pairs:
            assert logits.dtype == torch.float32 and logits.shape == (rows, 200)
            if dtype == torch.float32 or rows < 1024:  # (bf16 at 1,024 rows: oneDNN's dense GEMM, its own order)
                assert torch.equal(logits.to(dtype), linear)
            else:
                torch.testing.assert_close(logits.to(dtype), linear, rtol=2**-7, atol=2**-7)
            if dtype == torch.bfloat16:
                assert (logits != logits.to(torch.bfloat16).float()).any()
