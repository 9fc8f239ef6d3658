"""The CLI reference (docs/cli.md) rendered from the `tokenmill` argparse parsers, so `--help` and
the docs have one source: the flags declared in `tokenmill/options.py` and each command module.

    python -m tokenmill.cli.reference docs/cli.md          # rewrite the page
    python -m tokenmill.cli.reference --check docs/cli.md  # exit 1 when the page is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenmill.cli import build_parser

HEADER = """# Command-line reference

Every `tokenmill` subcommand and its flags, generated from the same parsers as `--help`
(`python -m tokenmill.cli.reference docs/cli.md`; a test fails when this page is stale).
Engine flags are declared once in `tokenmill/options.py` and shared by every command that takes them.
"""
_CODE_SPAN = re.compile(r"(`[^`]*`)")
_MARKDOWN_SPECIAL = re.compile(r"([\\*_<>\[\]|])")


def _text(help_text: str) -> str:
    """Plain help text as Markdown: specials escaped outside `code spans`, one line."""
    parts = _CODE_SPAN.split(" ".join(help_text.split()))
    return "".join(part if part.startswith("`") else _MARKDOWN_SPECIAL.sub(r"\\\1", part) for part in parts)


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line summary, parser) of each subcommand of `parser`, in registration order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name in summaries:  # aliases share the parser; list it once
                    yield name, summaries[name], sub


def _default(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch
        return {True: "on", False: "off"}.get(action.default, "")  # None: the help says what decides
    if action.default is None or action.default is argparse.SUPPRESS or action.default == "":
        return ""
    if isinstance(action.default, (list, tuple)):
        return " ".join(f"`{value}`" for value in action.default) if action.default else ""
    return f"`{action.default}`"


def _flag_groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[str]]]:
    """(title, table rows) of each argument group of `parser` that has flags."""
    formatter = parser._get_formatter()
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
        ]
        rows = [
            f"| `{formatter._format_action_invocation(a)}` | {_default(a)} | "
            f"{_text(formatter._expand_help(a) if a.help else '')} |"
            for a in actions
        ]
        if rows:
            yield group.title or "options", rows


class _Reference:
    """Renders commands depth first; a flag group identical to one already rendered (the engine
    flags most commands share) links to it instead of repeating it."""

    def __init__(self) -> None:
        self.lines = [HEADER.rstrip("\n")]
        self.seen: dict[tuple[str, ...], str] = {}

    def command(self, path: list[str], summary: str, parser: argparse.ArgumentParser) -> None:
        name = " ".join(path)
        anchor = name.replace(" ", "-")
        self.lines += ["", f"{'#' * min(len(path), 4)} `{name}`", ""]
        if parser.description or summary:
            self.lines.append(_text(parser.description or summary))
        for title, rows in _flag_groups(parser):
            key = (title, *rows)
            if key in self.seen:
                self.lines += ["", f"**{title}**: as for {self.seen[key]}."]
                continue
            self.seen[key] = f"[`{name}`](#{anchor})"
            self.lines += ["", f"**{title}**", "", "| flag | default | description |", "| --- | --- | --- |", *rows]
        for sub_name, sub_summary, sub in _subcommands(parser):
            self.command([*path, sub_name], sub_summary, sub)


def render() -> str:
    """docs/cli.md: every subcommand of `tokenmill`, depth first, with a table of flags per group."""
    reference = _Reference()
    for name, summary, sub in _subcommands(build_parser()):
        reference.command(["tokenmill", name], summary, sub)
    return "\n".join(reference.lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description="render the tokenmill CLI reference (docs/cli.md)")
    cli.add_argument("path", type=Path, help="the Markdown file to write (or check)")
    cli.add_argument("--check", action="store_true", help="do not write: exit 1 when PATH differs from the render")
    args = cli.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != text:
            print(f"{args.path} is stale: python -m tokenmill.cli.reference {args.path}", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
