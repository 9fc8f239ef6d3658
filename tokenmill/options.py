"""Command-line flags generated from settings dataclasses.

A settings field is declared with `option(default, help, ...)`: its default and help are written
once, on the field, and every command that exposes it (`serve`, `serve-ray`, `generate`, `bench`)
gets the same flag from `add_options`. `from_args` builds the dataclass back from parsed args.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_KEY = "tokenmill.option"


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    aliases: Iterable[str] = (),
    cli: bool = True,
    **argparse_kwargs: Any,
) -> Any:
    """A dataclass field with its command-line flag: `help`, the flag name (default `--field-name`),
    short `aliases`, and argparse keywords (type, choices, action, metavar). `cli=False`: no flag."""
    meta = {"help": help, "flag": flag, "aliases": tuple(aliases), "cli": cli, "argparse": argparse_kwargs}
    return field(default=default, metadata={_KEY: meta})


def option_help(cls: type, name: str) -> str:
    """The help text of `cls`'s option field `name` (for a command that restates it with another default)."""
    return next(f.metadata[_KEY]["help"] for f in fields(cls) if f.name == name)


def _argparse_kwargs(f: Field, meta: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = {"help": meta["help"], **meta["argparse"], **override}
    default = kwargs.setdefault("default", f.default)
    if "action" not in kwargs and isinstance(default, bool):
        # Off-by-default switches are plain flags; on-by-default ones need --no-... to turn off.
        kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
    if "action" not in kwargs and "type" not in kwargs and default is not None and default is not MISSING:
        kwargs["type"] = type(default)
    return kwargs


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add the flags of `cls`'s option fields (`only` these, none of `exclude`) to `parser`;
    `overrides` replaces argparse keywords per field (e.g. another default for one command)."""
    wanted = set(only) if only is not None else None
    skip = set(exclude)
    overrides = overrides or {}
    for f in fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is None or not meta["cli"] or f.name in skip or (wanted is not None and f.name not in wanted):
            continue
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs = _argparse_kwargs(f, meta, overrides.get(f.name, {}))
        if kwargs.get("action") is None and "choices" not in kwargs:
            kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        parser.add_argument(flag, *meta["aliases"], dest=f.name, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """`cls` (a dataclass) from the parsed flags of its fields (fields without a flag keep their
    default), with `values` taking precedence."""
    found = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**found, **values})
