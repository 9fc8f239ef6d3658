"""Builds tokenmill's C++ CPU kernels on first use and loads them as `torch.ops.tokenmill.*`.

The sources are compiled once per (torch version, vector ISA, source hash) into the model cache
(`<cache>/kernels/...`) with `torch.utils.cpp_extension` (needs a C++ compiler and ninja), for the
widest ISA this CPU has: AVX-512, AVX2+FMA, or plain C++. A machine that changes CPU kind finds or
builds the matching variant. Without a compiler, or with TOKENMILL_CPU_KERNELS=0, `load()` returns
False once with a logged reason, and callers keep their pure-torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

from tokenmill.kernels.cpu_caps import detect

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc" / "cpu"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
# Compiler flags per ISA, and the ATen CPU_CAPABILITY that selects the matching Vectorized<> code.
ISA_FLAGS: dict[str, tuple[list[str], str | None]] = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"], "AVX512"),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], "AVX2"),
    "generic": ([], None),
}
DISABLE_ENV = "TOKENMILL_CPU_KERNELS"
_DONE_MARKER = "built.ok"  # written after a build loaded fine


def compile_flags(isa: str) -> list[str]:
    flags, capability = ISA_FLAGS[isa]
    defines = [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"] if capability else []
    # -fopenmp: at::parallel_for runs on torch's own OpenMP pool (the same libgomp.so.1 torch loads).
    return ["-O3", "-fopenmp", *flags, *defines]


def build_directory(isa: str) -> Path:
    import torch

    from tokenmill.paths import cache_root

    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(compile_flags(isa)).encode())
    return cache_root() / "kernels" / f"torch{torch.__version__}-{isa}-{digest.hexdigest()[:12]}"


def disabled_reason() -> str | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0"
    return None


@functools.cache
def load() -> bool:
    """Build (once) and load the CPU kernels; False, with the reason logged, when they cannot be."""
    reason = disabled_reason()
    if reason is not None:
        logger.info("CPU kernels off (%s): pure-torch attention", reason)
        return False
    isa = detect().vector_isa
    directory = build_directory(isa)
    name = f"tokenmill_cpu_{isa}"
    start = time.perf_counter()
    try:
        import torch

        if (directory / _DONE_MARKER).exists():  # built before: load it (cpp_extension.load takes seconds)
            torch.ops.load_library(str(directory / f"{name}.so"))
        else:
            _compile(name, isa, directory)
            (directory / _DONE_MARKER).write_text("ok\n")
            logger.info("CPU kernels built in %.0f s", time.perf_counter() - start)
    except Exception as exc:
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        logger.warning(
            "tokenmill's CPU kernels could not be built or loaded (%s: %s); using pure-torch "
            "attention (gathers K/V blocks, slower)",
            type(exc).__name__,
            last_line,
        )
        return False
    logger.info("CPU kernels loaded: %s, on %s", isa, detect().describe())
    return True


def _compile(name: str, isa: str, directory: Path) -> None:
    """Compile and load; cpp_extension locks the directory, so concurrent first uses build once."""
    from torch.utils import cpp_extension

    logger.info("compiling tokenmill's CPU kernels for %s into %s (once, under a minute)", isa, directory)
    _put_ninja_on_path()
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        extra_cflags=compile_flags(isa),
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the `ninja` wheel (a dependency) installs it next to the
    interpreter, which is not on PATH when the venv is not activated."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
