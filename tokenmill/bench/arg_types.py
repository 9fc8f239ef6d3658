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


def _integer_from(value: str, low: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value!r}")
    return number


def positive_int(value: str) -> int:
    return _integer_from(value, 1)


def non_negative_int(value: str) -> int:
    return _integer_from(value, 0)


def range_ratio(value: str) -> float:
    ratio = float(value)
    if not 0.0 <= ratio < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value!r}")
    return ratio


def _number(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value!r}")
    return number


def non_negative_float(value: str) -> float:
    number = _number(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return number


def probability(value: str) -> float:
    """A number in [0, 1]."""
    number = _number(value)
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value!r}")
    return number


def nucleus_mass(value: str) -> float:
    """--top-p: a number in (0, 1]."""
    number = probability(value)
    if number == 0.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}")
    return number
