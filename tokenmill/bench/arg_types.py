"""argparse value types shared by the benchmark commands."""

from __future__ import annotations

import argparse
import math


def request_rate(value: str) -> float:
    """argparse type for --request-rate: a positive number of requests/s, or 'inf'."""
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {value!r}") from None
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'inf'), got {value!r}")
    return rate


def add_report_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """--json and --no-progress, as every engine benchmark has them."""
    parser.add_argument("--json", metavar="PATH", default=None, help=f"write {what} as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return number


def range_ratio(value: str) -> float:
    ratio = float(value)
    if not 0.0 <= ratio < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value!r}")
    return ratio
