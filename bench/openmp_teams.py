"""Why a server builds its engine on the engine thread: the same kernels on the thread that built
the weights, on a second thread (a second OpenMP team), and with all of it on one non-main thread.

    python bench/openmp_teams.py [--all-on-one-thread]

With two threads opening OpenMP regions there are more OpenMP threads than cores (on a 2-core
machine), and libgomp throttles its workers' spin, so each region wakes them from sleep.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
from amx_linear_vs_onednn import best_pass, layer_weights  # (bench/, next to this script)

from tokenmill.kernels import build


def suite(label: str) -> None:
    weights = layer_weights()
    gate_up = torch.randn(64, 2 * 1536).bfloat16()

    def gemms(x: torch.Tensor, w: torch.Tensor) -> None:
        torch.ops.tokenmill.onednn_linear(x, w, None)

    def silu() -> float:
        best = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(300):
                torch.ops.tokenmill.silu_mul(gate_up)
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    print(
        f"{label:28s} 120 GEMMs x64 {best_pass(gemms, weights, 64, 7):6.2f} ms, "
        f"x16 {best_pass(gemms, weights, 16, 7):6.2f} ms, 300 SiLU*up {silu():6.2f} ms",
        flush=True,
    )


def main() -> None:
    if not build.load():
        raise SystemExit("tokenmill's CPU kernels are not built here")
    if "--all-on-one-thread" in sys.argv:
        worker = threading.Thread(target=lambda: [suite("one (non-main) thread only") for _ in range(2)])
        worker.start()
        worker.join()
        return
    suite("main thread")
    worker = threading.Thread(target=suite, args=("second thread (second team)",))
    worker.start()
    worker.join()
    suite("main thread again")


if __name__ == "__main__":
    main()
