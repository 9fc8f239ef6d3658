"""pytest plugin: tokenmill's CPU kernels in their AVX-512 variant, on a CPU without AVX-512.

This project's machines change CPU kind (AMD EPYC with AVX2 only, Intel Xeon with AVX-512 and AMX),
and the kernels are compiled per ISA (tokenmill/kernels/build.py): on AVX2-only machines the avx512
variant was only ever compiled, never run. With this plugin (`make test-avx512-emulated`, part of
`make test` on such machines) the kernels are built with CPU_CAPABILITY_AVX512 but -mavx2 and
avx512_shim.h, whose 512-bit intrinsics are SIMDe's portable code, and the kernel tests run on
them: 16-lane vectors, 32-column panels, 12-row tiles and the AVX-512 branches of the sources,
checked against the same references as the native variant.

It must be loaded before tokenmill (`python -m pytest -p tests.isa_emulation.avx512 ...`): modules
bind `detect` when imported, so the emulated CPU is put in place first.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from tests.isa_emulation.variant import load_variant, skip_all
from tokenmill.kernels import cpu_caps

SHIM = Path(__file__).with_name("avx512_shim.h")
SIMDE_HEADER = Path("/usr/include/simde/x86/avx512.h")


def unavailable_reason(caps: cpu_caps.CpuCaps) -> str | None:
    if caps.avx512:
        return "this CPU has AVX-512: the native variant runs in the main suite"
    if not (caps.avx2 and caps.fma):
        return "the emulation runs on AVX2+FMA"
    if not SIMDE_HEADER.exists():
        return f"SIMDe is not installed ({SIMDE_HEADER}; apt-get install libsimde-dev)"
    return None


_REAL_CAPS = cpu_caps.detect()
_REASON = unavailable_reason(_REAL_CAPS)

if _REASON is None:
    from tokenmill.kernels import build

    _EMULATED = dataclasses.replace(_REAL_CAPS, avx512=True, torch_capability="AVX512")
    cpu_caps.detect = lambda: _EMULATED
    build.detect = cpu_caps.detect
    _native_flags = build.compile_flags

    def _emulated_flags(isa: str) -> list[str]:
        if isa != "avx512":
            return _native_flags(isa)
        shim_digest = hashlib.sha256(SHIM.read_bytes()).hexdigest()[:12]  # a changed shim rebuilds
        return [
            "-O3",
            "-fopenmp",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-include",
            str(SHIM),
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
            f"-DTOKENMILL_EMULATION={shim_digest}",
        ]

    build.compile_flags = _emulated_flags


def pytest_report_header() -> str:
    if _REASON is not None:
        return f"AVX-512 emulation: off ({_REASON})"
    return f"AVX-512 emulation: kernels built for avx512 with SIMDe on {_REAL_CAPS.describe()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _REASON is not None:
        skip_all(items, f"AVX-512 emulation off: {_REASON}")
        return
    # It reads the real compile flags, which this plugin replaces.
    flags_test = pytest.mark.skip(reason="checks the native compile flags, replaced under emulation")
    for item in items:
        if item.name == "test_kernel_builds_are_per_isa":
            item.add_marker(flags_test)


def pytest_sessionstart(session: pytest.Session) -> None:
    if _REASON is None:
        load_variant("emulated AVX-512", 32)
