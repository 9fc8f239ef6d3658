"""How many Ray Serve replicas and what each reserves (`tokenmill serve-ray` flags); no Ray import,
so building the CLI does not need Ray installed."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.options import option


@dataclass
class ScaleOptions:
    num_replicas: int = option(1, "replicas (the initial count with --max-replicas)")
    max_replicas: int | None = option(
        None, "autoscale between --min-replicas and this on ongoing requests per replica", type=int
    )
    min_replicas: int = option(1, "autoscaling lower bound")
    target_ongoing_requests: float = option(8.0, "autoscaling target: in-flight requests per replica")
    max_ongoing_requests: int | None = option(
        None, "requests Ray sends one replica at once (default: --max-num-seqs); the rest queue in Ray", type=int
    )
    num_cpus: float = option(
        1.0,
        "CPUs each CPU replica reserves (also its torch threads unless --num-threads)",
        flag="--num-cpus-per-replica",
    )
    num_gpus: float = option(1.0, "GPUs each replica reserves with --device cuda", flag="--num-gpus-per-replica")
    health_check_period_s: float = option(5.0, "", cli=False)

    def __post_init__(self) -> None:
        if self.num_replicas < 1 and self.max_replicas is None:
            raise ValueError("--num-replicas must be >= 1")
        if self.max_replicas is not None and (self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas)):
            raise ValueError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")
        if self.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        if self.num_cpus <= 0:
            raise ValueError("--num-cpus-per-replica must be > 0")
