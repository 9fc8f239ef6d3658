"""Every benchmark result names its machine and checkout (tokenmill/bench/provenance.py)."""

from __future__ import annotations

import re
from pathlib import Path

from tokenmill.bench import provenance
from tokenmill.bench.report import environment
from tokenmill.kernels.cpu_caps import CpuCaps


def test_the_machine_names_the_cpu_its_cores_and_the_features_the_kernels_use():
    amx = CpuCaps(avx2=True, fma=True, avx512=True, avx512_bf16=True, amx_bf16=True, amx_int8=True)
    assert provenance.describe_machine("Intel Xeon", 2, amx) == (
        "Intel Xeon, 2 cores (AVX2, AVX-512, AVX512-BF16, AMX-BF16, AMX-INT8)"
    )
    assert provenance.describe_machine("AMD EPYC", 16, CpuCaps(avx2=True, fma=True), gpu="NVIDIA H100") == (
        "AMD EPYC, 16 cores (AVX2); GPU: NVIDIA H100"
    )
    assert provenance.describe_machine("?", None, CpuCaps()) == "?, ? cores (no AVX2)"


def test_the_commit_is_this_checkouts():
    """A short id, marked when tracked files differ from it; None outside a git checkout."""
    if not (Path(provenance.__file__).parents[2] / ".git").exists():
        assert provenance.commit() is None
        return
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", provenance.commit() or "")


def test_engine_benchmarks_record_machine_and_commit():
    env = environment()
    assert env["machine"] == provenance.machine(env["cuda"]) and env["commit"] == provenance.commit()
    assert {"command", "date", "torch_version"} <= env.keys()
