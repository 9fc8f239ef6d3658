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

from tokenmill.kernels import build

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def suite(label: str) -> None:
    weights = [[torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k) / k ** 0.5).bfloat16(), 64)
                for n, k in SHAPES] for _ in range(30)]
    gate_up = torch.randn(64, 2 * 1536).bfloat16()

    def best(fn) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    def gemms(rows: int) -> None:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer):
                torch.ops.tokenmill.onednn_linear(xs[k], w, None)

    def silu() -> None:
        for _ in range(300):
            torch.ops.tokenmill.silu_mul(gate_up)

    print(f"{label:28s} 120 GEMMs x64 {best(lambda: gemms(64)):6.2f} ms, x16 {best(lambda: gemms(16)):6.2f} ms, "
          f"300 SiLU*up {best(silu):6.2f} ms", flush=True)


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
