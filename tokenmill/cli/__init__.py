"""`tokenmill` command line: each area of the product registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tokenmill.server.omp import server_omp_settings

# Modules that expose `register(subparsers)`; each adds its subcommands with their own --help.
COMMAND_MODULES = [
    "tokenmill.cli.generate",
    "tokenmill.cli.models",
    "tokenmill.cli.serve",
    "tokenmill.cli.bench",
    "tokenmill.cli.serve_ray",
    "tokenmill.cli.export",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="tokenmill: high-throughput LLM inference (continuous batching, paged KV cache, OpenAI API).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "server_omp", False):
        # Server processes share their cores between the engine thread and the HTTP threads: OpenMP
        # workers spin a bounded while, then sleep (tokenmill/server/omp.py). Must be set before torch is
        # imported (building the parser does not import it; tests/server/test_server_omp.py); an explicit
        # OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
        os.environ.update(server_omp_settings(os.environ))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:  # user errors: a message, not a traceback
        print(f"tokenmill {args.command}: error: {exc}", file=sys.stderr)
        return 2
