"""Open-loop load generator for OpenAI-compatible servers (`tokenmill bench serve`).

Requests go to `POST /v1/completions` with `stream: true`; each request's start, first content chunk,
later content chunks and end are timed to give TTFT, ITL, TPOT and end-to-end latency. Arrivals
follow a seeded Poisson process, so two servers driven with the same seed see the same trace.
"""

from tokenmill.bench.serve.cli import main

__all__ = ["main"]
