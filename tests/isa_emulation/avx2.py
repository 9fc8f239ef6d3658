"""pytest plugin: tokenmill's CPU kernels in their AVX2 variant, on a CPU with AVX-512.

The counterpart of avx512.py: this project's machines change CPU kind, and on an AVX-512 machine
the main suite runs the kernels' avx512 variant only, leaving the AVX2 one (what the AMD EPYC
machines run) unbuilt. With this plugin (`make test-avx2-variant`, part of `make test` on such
machines) the kernels are built for avx2 and the kernel tests run on them natively (an AVX-512 CPU
runs AVX2 code): 8-lane vectors, 16-column panels and the AVX2 branches of the sources, checked
against the same references as the avx512 variant.

It must be loaded before tokenmill (`python -m pytest -p tests.isa_emulation.avx2 ...`): modules
bind `detect` when imported, so the narrower CPU is put in place first.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.isa_emulation.variant import load_variant, skip_all
from tokenmill.kernels import cpu_caps

_REAL_CAPS = cpu_caps.detect()
_REASON = None if _REAL_CAPS.avx512 else "this CPU has no AVX-512: the main suite runs the AVX2 variant"

if _REASON is None:
    from tokenmill.kernels import build

    _NARROWED = dataclasses.replace(_REAL_CAPS, avx512=False, torch_capability="AVX2")
    cpu_caps.detect = lambda: _NARROWED
    build.detect = cpu_caps.detect


def pytest_report_header() -> str:
    if _REASON is not None:
        return f"AVX2 variant on AVX-512: off ({_REASON})"
    return f"AVX2 variant: kernels built for avx2 on {_REAL_CAPS.describe()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _REASON is not None:
        skip_all(items, f"AVX2 variant run off: {_REASON}")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _REASON is None:
        load_variant("AVX2", 16)
