"""`tokenmill models`: the architectures tokenmill serves and which path serves each."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the supported model architectures and which path (native/generic) serves each",
        description="List every supported architecture: its config.json model_type, the Hugging Face classes "
        "it covers, the path that serves it (native: tokenmill's own model code; generic: the "
        "transformers module over tokenmill's paged attention) and its notable features.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per architecture")
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list every other causal-LM architecture of the installed transformers: "
        "'generic' (the generic path would run it, untested) or 'refused' with the reason "
        "(imports every transformers model class: takes a while)",
    )
    parser.set_defaults(func=_list_models)


def _list_models(args: argparse.Namespace) -> int:
    from tokenmill.models.model_loader.registry import architectures

    rows = [(a.model_type, ", ".join(a.hf_architectures), a.path, a.features) for a in architectures()]
    if args.all:
        from tokenmill.models.model_loader.transformers_backend import untested_architectures

        listed = {row[0] for row in rows}
        rows += [
            (a.model_type, ", ".join(a.hf_architectures), "refused" if reason else a.path, reason or a.features)
            for a, reason in untested_architectures()
            if a.model_type not in listed
        ]
    if args.json:
        for model_type, classes, path, features in rows:
            print(
                json.dumps(
                    {"model_type": model_type, "architectures": classes.split(", "), "path": path, "features": features}
                )
            )
        return 0
    header = ("model_type", "architectures", "path", "features")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    return 0
