"""What every engine runner shares: arguments, the workload file, the result line. Standard library
only: it runs inside each engine's own virtualenv."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from pathlib import Path


def parser(engine: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"run tokenmill's offline workload on {engine}")
    p.add_argument("--workload", required=True, help="workload JSON written by peers.py")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument(
        "--kv-cache",
        default="compute",
        choices=["compute", "int8"],
        help="KV cache precision: the compute precision, or 8-bit integers with scales",
    )
    p.add_argument(
        "--weights",
        default="compute",
        choices=["compute", "int8", "gguf"],
        help="weight precision: the compute precision, 8-bit integers with scales, or a GGUF file's own "
        "(--model is the file)",
    )
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", required=True, help="result JSON path")
    return p


def load_workload(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())


def max_len(workload: list[dict]) -> int:
    return max(len(r["prompt_token_ids"]) + r["output_len"] for r in workload)


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def write_result(
    out: str,
    engine: str,
    precision: str,
    output_tokens: int,
    wall_s: float,
    requested: int,
    kv_cache: str,
    weights: str | None = None,
    **extra,
) -> None:
    """`kv_cache`: the KV cache precision the engine really ran with, in its own words (e.g. f32, u8);
    `weights`: the 8-bit weight format it ran with (None: weights in the compute precision)."""
    result = {
        "engine": engine,
        "precision": precision,
        "kv_cache": kv_cache,
        "weights": weights,
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "requested_tokens": requested,
        **extra,
    }
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    if output_tokens != requested:
        print(f"warning: {engine} produced {output_tokens} tokens, {requested} were requested")


def wait_until_ok(url: str, server: subprocess.Popen, timeout: float) -> None:
    """Poll `url` until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
