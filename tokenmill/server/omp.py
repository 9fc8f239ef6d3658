"""How a server's OpenMP threads wait between parallel regions: set before torch loads libgomp.

A server's engine thread runs the model's parallel regions (hundreds a step) while the HTTP threads
share the cores. Its OpenMP workers spin a bounded while after each region (GOMP_SPINCOUNT=100000,
a few ms) and then sleep: long enough to bridge the gaps between a step's regions and between steps,
short enough to leave an idle server's cores alone.

History: servers used OMP_WAIT_POLICY=PASSIVE (workers sleep at once), chosen while a server process
ran two OpenMP teams (the model was built on the main thread, stepped on the engine thread), when
libgomp's spinning starved the event loop (10x slower steps on a busy 2-core machine) and, with more
OpenMP threads than cores, libgomp throttled any spin to ~1,000 turns anyway (so no bounded spin won:
bench/README.md). Since the engine is built and stepped on one thread (engine/async_engine.py), the
spin pays: `python bench/peers/peers.py serve --concurrency 16 64 tokenmill` (2-core Xeon with AMX,
bf16, runs interleaved) gave 16 / 64 streams 273.7 / 407.0 and 286.3 / 424.1 tok/s passive,
344.3 / 488.3 and 345.0 / 520.4 with GOMP_SPINCOUNT=100000, 365.2 / 487.8 with libgomp's 300000.
Offline work (`LLM`) keeps libgomp's default.
"""

from __future__ import annotations

from collections.abc import Mapping

SERVER_OMP_ENV = {"GOMP_SPINCOUNT": "100000"}


def server_omp_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait settings a server process adds to `environ`: none when it sets its own
    (OMP_WAIT_POLICY, or libgomp's GOMP_SPINCOUNT)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return dict(SERVER_OMP_ENV)
