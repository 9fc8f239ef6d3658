"""tokenmill/kernels/ops.py, the kernels' one Python entry point: every op registered in
csrc/cpu/bindings.cpp has a wrapper, and the ops' fake implementations let torch.compile trace
through them (one graph, the eager kernels' results)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import build, ops

pytestmark = pytest.mark.skipif(not build.load(), reason="tokenmill's CPU kernels are not built here")


def test_every_registered_op_has_a_wrapper():
    """Every op of bindings.cpp but the load-time probes of the CPU and of a weight's layout (called
    by the kernels that use them) is called through ops.py."""
    schemas = {
        s.name.removeprefix("tokenmill::") for s in torch._C._jit_get_all_schemas() if s.name.startswith("tokenmill::")
    }
    probes = {
        "amx_logits_applies",
        "onednn_amx_layout",
        "amx_int8_usable",
        "amx_bf16_usable",
        "amx_linear",
        "onednn_padded_rows",
        "onednn_batch_hint",
    }
    assert "packed_linear" in schemas
    assert sorted(name for name in schemas - probes if not hasattr(ops, name)) == []


def test_torch_compile_traces_through_the_kernels():
    """fullgraph=True: a graph break at any op (no fake implementation) fails."""
    gen = torch.Generator().manual_seed(0)
    weight, norm = torch.randn(40, 64, generator=gen), torch.rand(64, generator=gen)
    panels = ops.pack_linear_weight(weight)
    q = torch.randint(-127, 128, (40, 64), generator=gen, dtype=torch.int8)
    int8 = ops.pack_int8_weight(q)
    scales = ops.pack_linear_weight(torch.rand(40, 2, generator=gen).bfloat16())

    def step(x: torch.Tensor) -> torch.Tensor:
        h = ops.rms_norm(x, norm, 1e-6)
        a = ops.packed_linear(h, panels, None, 40)
        b = ops.packed_int8_linear(h, int8, scales, None, 40)
        return ops.silu_mul(torch.cat([a, b], dim=-1))

    x = torch.randn(5, 64, generator=gen)
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))
    assert torch.equal(compiled(x[:3]), step(x[:3]))
