"""How a server's OpenMP threads wait between parallel regions: set before torch loads libgomp.

A server's engine thread runs the model's parallel regions (hundreds a step) while the HTTP threads
share the cores. Its OpenMP workers spin a bounded while after each region (GOMP_SPINCOUNT=100000,
a few ms) and then sleep: long enough to bridge the gaps between a step's regions and between steps,
short enough to leave an idle server's cores alone.

The spin pays because the engine is built and stepped on one thread (engine/async_engine.py): one
OpenMP team. With two teams (more OpenMP threads than cores) libgomp throttles any spin, so each
region wakes its workers from sleep (`python bench/openmp_teams.py`). Against sleeping at once
(OMP_WAIT_POLICY=PASSIVE) and libgomp's longer default spin, `python bench/peers/peers.py serve
--concurrency 16 64 tokenmill` measures a streaming load's throughput (a server keeps the
OMP_WAIT_POLICY or GOMP_SPINCOUNT it is started with). Offline work (`LLM`) keeps libgomp's default.
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
