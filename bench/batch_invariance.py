"""Batch invariance, measured: does a prompt get the same greedy tokens alone as in one batch with
others, and what does `--batch-invariant` cost in offline throughput?

`same`: each prompt of the peers workload (16-512 prompt tokens) is run alone (its prefill in one
chunk, then batch-1 decodes), then all of them at once (steps of every size, prompts cut into chunks
by the token budget), with `--batch-invariant` and with `--no-batch-invariant`; a prompt counts when
its tokens are identical.

`cost`: `tokenmill bench offline` on the peers workload (64 requests, prompts 16-512, outputs
32-256), `--runs` times with each setting, alternated (each run a fresh process), the median
tok/s of each and the cost of invariance (1 - on / off).

`serve`: the peers workload served (bench/peers: streaming /v1/completions, prompts 256 +-50%
tokens, outputs 128 +-50%): a `tokenmill serve` with each setting in turn, loaded by `tokenmill
bench serve` at each `--concurrency` (each load its own prompts, trace seeds 0, 1, ..., the same
for both settings, so no load is answered from the prefix cache of an earlier one); output tok/s
and p50 TTFT per load, and the cost of invariance per load.

    python bench/batch_invariance.py same --dtype bfloat16 [--json FILE]
    python bench/batch_invariance.py cost --dtype bfloat16 --runs 3 [--json FILE]
    python bench/batch_invariance.py serve --dtype bfloat16 --concurrency 1 16 64 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.bench.engine_args import add_bench_engine_args, engine_kwargs, resolve_bench_model
from tokenmill.bench.offline.workload import make_workload
from tokenmill.bench.report import environment, write_json

PEERS_WORKLOAD = ["--num-prompts", "64", "--min-input", "16", "--max-input", "512", "--min-output", "32"]
PEERS_WORKLOAD += ["--max-output", "256"]
SERVE_WORKLOAD = ["--input-len", "256", "--output-len", "128", "--range-ratio", "0.5"]
SETTINGS = {"on": "--batch-invariant", "off": "--no-batch-invariant"}


def same_tokens(args: argparse.Namespace, engine_args: argparse.Namespace) -> dict[str, Any]:
    model_dir = resolve_bench_model(engine_args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, Any] = {}
    for name, invariant in (("on", True), ("off", False)):
        kwargs = engine_kwargs(engine_args, model_dir, batch_invariant=invariant)
        llm = LLM(kwargs.pop("model"), progress=False, **kwargs)
        vocab = llm.engine.spec.vocab_size
        workload = make_workload(args.num_prompts, 16, 512, 1, 1, vocab, seed=engine_args.seed)
        prompts = [request.prompt_token_ids for request in workload]
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        parted = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(alone, batch)]
        same = sum(p is None for p in parted)
        dtype = str(llm.engine.dtype).removeprefix("torch.")
        result[name] = {"dtype": dtype, "prompts": len(prompts), "identical": same, "first_differing_token": parted}
        print(
            f"{dtype}, batch invariance {name}: {same}/{len(prompts)} prompts give the same "
            f"{args.output_len} greedy tokens alone and in one batch (first differing token: {parted})"
        )
    return result


def cost(args: argparse.Namespace, engine_flags: list[str]) -> dict[str, Any]:
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for name, flag in SETTINGS.items():
                out = Path(tmp) / f"{name}-{run}.json"
                command = ["tokenmill", "bench", "offline", *PEERS_WORKLOAD, *engine_flags, flag, "--no-progress"]
                subprocess.run([*command, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
                tok_s = json.loads(out.read_text())["tokenmill"]["output_throughput"]
                runs[name].append(tok_s)
                print(f"run {run + 1}/{args.runs}, batch invariance {name}: {tok_s:.1f} tok/s", flush=True)
    median = {name: statistics.median(values) for name, values in runs.items()}
    result = {"tok_s": runs, "median_tok_s": median, "cost": 1 - median["on"] / median["off"]}
    print(f"median tok/s: on {median['on']:.1f}, off {median['off']:.1f}: invariance costs {result['cost']:.1%}")
    return result


def served(args: argparse.Namespace, engine_flags: list[str]) -> dict[str, Any]:
    from tokenmill.bench.compare import free_port, start_server, stop_server, wait_ready

    loads: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flag in SETTINGS.items():
            port = free_port()
            command = ["tokenmill", "serve", *engine_flags, flag, "--host", "127.0.0.1", "--port", str(port)]
            server = start_server(f"tokenmill-{name}", command, port, "/health/ready", Path(tmp))
            try:
                wait_ready([server], 900)
                for seed, concurrency in enumerate(args.concurrency):
                    out = Path(tmp) / f"{name}-c{concurrency}.json"
                    load = ["--num-prompts", str(args.serve_prompts), "--max-concurrency", str(concurrency)]
                    bench = ["tokenmill", "bench", "serve", "--url", server.url, *SERVE_WORKLOAD, *load]
                    subprocess.run(
                        [*bench, "--seed", str(seed), "--json", str(out)], check=True, stdout=subprocess.DEVNULL
                    )
                    report = json.loads(out.read_text())
                    point = {
                        "max_concurrency": concurrency,
                        "output_throughput": report["output_throughput"],
                        "p50_ttft_ms": report["ttft"]["p50_ms"],
                        "completed": report["completed"],
                        "cached_input_tokens": report["cached_input_tokens"],
                    }
                    loads[name].append(point)
                    print(f"batch invariance {name}, concurrency {concurrency}: {point}", flush=True)
            finally:
                stop_server(server)
    cost_by_load = {
        str(on["max_concurrency"]): 1 - on["output_throughput"] / off["output_throughput"]
        for on, off in zip(loads["on"], loads["off"])
    }
    for concurrency, value in cost_by_load.items():
        print(f"concurrency {concurrency}: invariance costs {value:.1%} of output tok/s")
    return {"num_prompts": args.serve_prompts, "loads": loads, "cost": cost_by_load}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="other flags: the engine's")
    parser.add_argument("what", choices=["same", "cost", "serve"])
    parser.add_argument("--num-prompts", type=int, default=16, help="same: prompts (default: 16)")
    parser.add_argument("--output-len", type=int, default=64, help="same: greedy tokens per prompt (default: 64)")
    parser.add_argument("--runs", type=int, default=3, help="cost: runs of each setting (default: 3)")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 16, 64], help="serve: loads (default: 1 16 64)"
    )
    parser.add_argument("--serve-prompts", type=int, default=64, help="serve: requests per load (default: 64)")
    parser.add_argument("--json", default=None, help="write the result here")
    args, engine_flags = parser.parse_known_args()
    engine_parser = argparse.ArgumentParser()
    add_bench_engine_args(engine_parser)
    engine_args = engine_parser.parse_args(engine_flags)
    if args.what == "same":
        result = same_tokens(args, engine_args)
    elif args.what == "cost":
        result = cost(args, engine_flags)
    else:
        result = served(args, engine_flags)
    if args.json:
        env = {**environment(), "command": shlex.join(["python", *sys.argv])}
        write_json(args.json, {"environment": env, "what": args.what, "flags": engine_flags, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
