"""The documentation site builds with `mkdocs build --strict`: a broken link, a missing anchor or a
page left out of the nav fails the suite."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')",
)


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(root / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_docs_build_strict(tmp_path):
    result = _build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "cli" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    with (copy / "docs" / "index.md").open("a", encoding="utf-8") as page:
        page.write("\nSee [the missing page](no-such-page.md) and [a lost section](api.md#no-such-anchor).\n")
    result = _build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr
