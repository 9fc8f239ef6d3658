"""How a benchmark's requests pick their tokens: greedy by default (runs then compare token for
token, and with HF), or sampled as most traffic is (`--temperature`, `--top-p`, `--top-k`,
`--min-p`), the same settings in every request of the workload."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.arg_types import non_negative_float, non_negative_int, nucleus_mass, probability


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        top_k = self.top_k or "off"
        return f"sampled: temperature {self.temperature}, top_p {self.top_p}, top_k {top_k}, min_p {self.min_p}"

    def request_fields(self) -> dict[str, Any]:
        """The settings as fields of an OpenAI completion request (top_k and min_p, vLLM's extra
        fields, only when set)."""
        fields: dict[str, Any] = {"temperature": self.temperature}
        if self.top_p < 1.0:
            fields["top_p"] = self.top_p
        if self.top_k:
            fields["top_k"] = self.top_k
        if self.min_p:
            fields["min_p"] = self.min_p
        return fields


GREEDY = Sampling()


def add_sampling_args(group: argparse._ArgumentGroup, note: str = "") -> None:
    group.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        metavar="T",
        help=f"sampling temperature of every request{note} (default: 0, greedy)",
    )
    group.add_argument(
        "--top-p", type=nucleus_mass, default=1.0, metavar="P", help="nucleus sampling mass (default: 1, off)"
    )
    group.add_argument(
        "--top-k", type=non_negative_int, default=0, metavar="K", help="top-k sampling (default: 0, off)"
    )
    group.add_argument(
        "--min-p",
        type=probability,
        default=0.0,
        metavar="P",
        help="min-p sampling, relative to the most likely token (default: 0, off)",
    )


def sampling_from_args(args: argparse.Namespace) -> Sampling:
    return Sampling(args.temperature, args.top_p, args.top_k, args.min_p)
