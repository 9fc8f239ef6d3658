"""bench/README.md's result tables are the render of bench/results/: no result file left out, none
without its machine, date and commit, no table edited by hand, no path to a result that is gone."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"


@pytest.fixture(scope="module")
def render_results():
    spec = importlib.util.spec_from_file_location("render_results", BENCH / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _summaries() -> list[Path]:
    """Every result file that stands for a run: the top-level JSONs and each peers run's summary
    (the per-engine and per-load files beside them are its raw parts)."""
    return sorted([*RESULTS.glob("*.json"), *RESULTS.glob("peers/**/peers.json"), *RESULTS.glob("peers/**/serve.json")])


def test_readme_tables_are_current(render_results):
    assert render_results.main(["--check"]) == 0, "stale: python bench/render_results.py"


def test_every_result_is_rendered_with_its_provenance(render_results):
    rendered = render_results.rendered_files()
    for path in _summaries():
        assert str(path.relative_to(RESULTS)) in rendered, f"{path} is in no table of bench/render_results.py"
        environment = json.loads(path.read_text())["environment"]
        for key in ("command", "date", "machine", "commit"):
            assert environment.get(key), f"{path}: environment.{key} missing"
    assert all((RESULTS / name).exists() for name in rendered)


def test_paths_in_the_readme_exist():
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    for path in set(re.findall(r"(?<![\w/])bench/results/[a-z0-9./-]+\.(?:json|png)", text)):
        assert (BENCH.parent / path).exists(), path
    for script in set(re.findall(r"(?<![\w/])bench/[\w/]+\.(?:py|sh)", text)):
        assert (BENCH.parent / script).exists(), script
