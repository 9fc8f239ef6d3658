"""How a server's OpenMP threads wait between parallel regions: set before torch loads libgomp.

A server shares its cores between the engine thread and the HTTP threads: OpenMP workers that spin
while they wait for work starve the event loop (libgomp's default spins ~3 ms after each parallel
region: 10x slower steps on a busy 2-core machine), so a server's workers sleep at once
(OMP_WAIT_POLICY=PASSIVE). Offline work (`LLM`) keeps libgomp's default, ~15% faster there.
A bounded spin instead (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=1000 or 10000) was measured under
`tokenmill bench serve` on a 2-core AMD EPYC: one stream 15.1-19.9 ms a token (bimodal) against
16.5-17.9 passive, 16 and 64 streams +1-2%: no reliable gain. Nor did building the engine on its
own thread (one OpenMP pool instead of two) with PASSIVE, libgomp's default or a bounded spin
(bench/README.md, "The panel GEMM requests its next panel").
"""

from __future__ import annotations

from collections.abc import Mapping

SERVER_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def server_omp_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait settings a server process adds to `environ`: none when it sets its own
    (OMP_WAIT_POLICY, or libgomp's GOMP_SPINCOUNT)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return dict(SERVER_OMP_ENV)
