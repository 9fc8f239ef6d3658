"""Batch invariance where tokenmill's row-invariant CPU kernels do not run (CUDA, or a CPU without
them): library ops on fixed shapes (tokenmill.models.layers.fixed_shapes), checked here on the CPU,
where the same torch code runs (tests/gpu runs it on CUDA)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from tests.kernels.test_batch_invariance import CACHE_DTYPES, check_split_invariance
from tests.kernels.test_cpu_kernels import _case, _reference
from tokenmill.models.families.llama import RMSNorm
from tokenmill.models.layers.fixed_shapes import ROWS, FixedRows, FixedRowsMethod, fixed_block_attention
from tokenmill.models.layers.linear import UNQUANTIZED, linear_with


def _attend(c: dict) -> torch.Tensor:
    lens = [q for _, q in c["seqs"]]
    width = max(len(t) for t in c["tables"])
    return fixed_block_attention(
        c["q"],
        c["k_cache"],
        c["v_cache"],
        torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in c["tables"]], dtype=torch.int32),
        torch.tensor([ctx for ctx, _ in c["seqs"]], dtype=torch.int32),
        c["block"],
        c["scale"],
        c["window"],
        c["softcap"],
    )


@pytest.mark.parametrize("seed", range(12))
def test_fixed_block_attention_matches_sdpa(seed):
    """Decodes and multi-query chunks, GQA, head sizes, block sizes, windows, softcaps; unowned cache
    slots hold NaN (a read outside a sequence's visible keys would poison its output)."""
    c = _case(random.Random(seed), torch.float32)
    out = _attend(c)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference(c), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_dtype, cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("seed", range(2))
def test_fixed_block_attention_rows_do_not_depend_on_the_split(seed, q_dtype, cache_dtype):
    check_split_invariance(seed, q_dtype, cache_dtype, _attend, max_context=140)  # (past two key blocks)


def _fixed_linear() -> torch.nn.Module:
    return linear_with(torch.nn.Linear(48, 30), FixedRowsMethod(UNQUANTIZED))


@pytest.mark.parametrize(
    "make",
    [_fixed_linear, lambda: FixedRows(RMSNorm(48, 1e-6))],
    ids=["linear method", "rms_norm"],
)
def test_row_wise_modules_on_fixed_rows_keep_their_results_and_rows(make):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3 * ROWS + 5, 48, generator=gen)
    fixed = make()
    with torch.no_grad():
        torch.testing.assert_close(fixed(x), torch.cat([fixed(rows) for rows in x.split(ROWS)]))
        alone = torch.cat([fixed(row[None]) for row in x])
        for rows in (1, 7, ROWS, ROWS + 1, x.shape[0]):
            assert torch.equal(fixed(x[:rows]), alone[:rows]), rows
        assert torch.equal(fixed(x.view(-1, 1, 48)), alone.view(-1, 1, alone.shape[-1]))  # any leading shape
    assert fixed.weight is not None  # (attributes read through)


def test_a_fixed_rows_method_computes_and_holds_the_layer_as_its_inner_method():
    gen = torch.Generator().manual_seed(2)
    plain = torch.nn.Linear(48, 30)
    x = torch.randn(2 * ROWS + 3, 48, generator=gen)
    with torch.no_grad():
        expected, expected_logits = plain(x), plain(x).float()
        layer = linear_with(plain, FixedRowsMethod(UNQUANTIZED))
        torch.testing.assert_close(layer(x), expected)
        torch.testing.assert_close(layer.logits(x), expected_logits)
    assert torch.equal(layer.dequantized(torch.float32), plain.weight)
    assert layer.quant_method.tensor_names == UNQUANTIZED.tensor_names
    assert layer.quant_method.fused_projection(layer, torch.float32) is None
    assert "on fixed rows" in layer.quant_method.describe(layer)


_WITHOUT_KERNELS = """
import sys
from tests.conftest import mixed_prompts, run_staggered
from tokenmill import LLM, SamplingParams
from tokenmill.models.layers.fixed_shapes import FixedRows, FixedRowsMethod
from tokenmill.models.layers.linear import linear_layers

model, dtype = sys.argv[1:]
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
prompts = mixed_prompts(8, 1, 90, seed=21)
pick = lambda out: (out.token_ids, out.logprobs)
llm = LLM(model, progress=False, dtype=dtype, kv_cache_memory="32MiB", batch_invariant=True)
assert any(isinstance(m, FixedRows) for m in llm.engine.model.modules())
assert all(isinstance(layer.quant_method, FixedRowsMethod) for _, layer in linear_layers(llm.engine.model))
alone = [pick(llm.generate([p], params)[0].outputs[0]) for p in prompts]
mixed = LLM(model, progress=False, dtype=dtype, kv_cache_memory="32MiB", batch_invariant=True,
            max_num_batched_tokens=32)
assert run_staggered(mixed, prompts, params, per_step=3, pick=pick) == alone
print("invariant")
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_without_the_cpu_kernels_keeps_batch_invariance(tiny_model_dir, dtype):
    """TOKENMILL_CPU_KERNELS=0, --batch-invariant: the fixed-shape path on the CPU; each prompt's
    tokens and logprobs alone equal those in staggered batches with chunked prefill, bit for bit."""
    import os

    env = {**os.environ, "TOKENMILL_CPU_KERNELS": "0"}
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_KERNELS, str(tiny_model_dir), dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and "invariant" in result.stdout, result.stderr[-3000:]
