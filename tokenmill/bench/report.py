"""What every benchmark reports with: latency statistics, the plain-text table, strict JSON and
the environment a result was measured in."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench import provenance

PERCENTILES: tuple[int, ...] = (50, 90, 99)


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[float] = PERCENTILES) -> dict[Any, float]:
    """Linear-interpolated percentiles (numpy's default, as vLLM reports them)."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return dict.fromkeys(qs, math.nan)
    return {q: float(np.percentile(arr, q)) for q in qs}


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles in milliseconds (NaN when there were no samples)."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if len(values) == 0:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ms = np.asarray(values, dtype=float) * 1000.0
        p = percentiles(ms, PERCENTILES)
        return cls(float(ms.mean()), p[50], p[90], p[99])


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def format_cell(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_grid(table: Sequence[Sequence[str]], title: str | None = None) -> str:
    """A plain-text table of a header row and rows of cells: the first column left-aligned, the
    others right-aligned, between rules (every benchmark prints its results this way)."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]

    def line(cells: Sequence[str]) -> str:
        padded = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded)

    rule = "-" * len(line(table[0]))
    head = [rule, title, rule] if title else [rule]
    return "\n".join([*head, line(table[0]), rule, *(line(r) for r in table[1:]), rule])


def write_json(path: str | Path, data: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def environment() -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover
        tf_version = None
    return {
        "command": " ".join(shlex.quote(a) for a in ["tokenmill", *sys.argv[1:]]) if sys.argv else None,
        "argv": list(sys.argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "machine": provenance.machine(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None),
        "commit": provenance.commit(),
    }


def print_report(args: argparse.Namespace, table: str | None, data: dict[str, Any]) -> int:
    """How every engine benchmark ends: print its table, write `data` and the environment as JSON
    to --json (which `tokenmill bench` gives every engine benchmark) when given; returns the exit code."""
    if table is not None:
        print(table)
    if args.json:
        write_json(args.json, json_safe({"environment": environment(), **data}))
    return 0
