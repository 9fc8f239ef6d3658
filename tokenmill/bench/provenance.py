"""Where a benchmark ran: the machine and the checkout, written into every result file so that a
table of results (bench/README.md) says which machine and which code each figure comes from."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tokenmill.kernels.cpu_caps import CpuCaps, detect

_REPO = Path(__file__).resolve().parents[2]
# (CpuCaps field, the name a reader knows it by)
_FEATURES = (
    ("avx2", "AVX2"),
    ("avx512", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("amx_bf16", "AMX-BF16"),
    ("amx_int8", "AMX-INT8"),
)


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def describe_machine(model: str, cores: int | None, caps: CpuCaps, gpu: str | None = None) -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores (AVX2, AVX-512, AVX512-BF16, AMX-BF16, AMX-INT8)' (+ the GPU)."""
    features = ", ".join(name for field, name in _FEATURES if getattr(caps, field)) or "no AVX2"
    text = f"{model}, {cores or '?'} cores ({features})"
    return f"{text}; GPU: {gpu}" if gpu else text


def machine(gpu: str | None = None) -> str:
    """This machine's CPU model, core count and the vector features tokenmill's kernels use."""
    return describe_machine(_cpu_model(), os.cpu_count(), detect(), gpu)


def commit() -> str | None:
    """The checkout tokenmill runs from: a short commit id, '+changes' when tracked files differ from
    it; None outside a git checkout (an installed wheel)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        changed = subprocess.run(
            ["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")
