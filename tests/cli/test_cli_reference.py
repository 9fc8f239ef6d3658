"""docs/cli.md is the render of the `tokenmill` parsers: a flag added, renamed or re-documented
without regenerating the page fails here."""

from __future__ import annotations

from pathlib import Path

from tokenmill.cli import build_parser
from tokenmill.cli.reference import main, render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_md_is_current():
    assert PAGE.read_text(encoding="utf-8") == render(), "stale: python -m tokenmill.cli.reference docs/cli.md"


def test_every_flag_of_every_command_is_in_the_reference():
    text = render()
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for command in ("generate", "serve", "serve-ray", "export", "models"):
        for action in commands[command]._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in text, (command, flag)


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    page = tmp_path / "cli.md"
    page.write_text("# old\n", encoding="utf-8")
    assert main(["--check", str(page)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main([str(page)]) == 0 and main(["--check", str(page)]) == 0
