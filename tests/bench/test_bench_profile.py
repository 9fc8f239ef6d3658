"""`tokenmill bench profile`: step time split into attention, GEMMs, elementwise, sampler and host."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench import profile


@pytest.mark.engine
def test_profile_runs_and_splits_the_step(tiny_model_dir, monkeypatch, tmp_path, capsys):
    from tokenmill.cli import build_parser

    monkeypatch.setattr(profile, "resolve_bench_model", lambda model: tiny_model_dir)
    out = tmp_path / "profile.json"
    args = build_parser().parse_args(
        [
            "bench",
            "profile",
            "--workloads",
            "decode-bs1",
            "mixed",
            "--steps",
            "2",
            "--context",
            "8",
            "--kv-cache-memory",
            "64MiB",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "Step profile" in printed and "attention:" in printed
    report = json.loads(out.read_text())
    bs1, mixed = report["profiles"]
    assert (bs1["name"], bs1["tokens_per_step"]) == ("decode-bs1", 1.0)
    assert mixed["tokens_per_step"] > 1  # prefill chunks next to decodes
    for p in (bs1, mixed):
        assert abs(sum(p["shares"].values()) - 1.0) < 0.02  # host time is what ops did not take
        assert p["shares"]["attention"] > 0 and p["shares"]["gemm"] > 0 and p["shares"]["sampler"] > 0
        assert p["ms_per_step"] > 0 and p["top_ops"]


def test_ops_are_categorised_by_scope_then_name():
    class Event:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    attention = Event("tokenmill::attention")
    assert profile._category(Event("aten::bmm", Event("aten::matmul", attention))) == "attention"
    assert profile._category(Event("aten::mm", Event("aten::linear"))) == "gemm"
    assert profile._category(Event("aten::add")) == "elementwise"
    assert profile._category(Event("aten::argmax", Event("tokenmill::sampler"))) == "sampler"


@pytest.mark.engine
def test_kernels_bench_reports_attention_projection_and_gemms(tiny_model_dir, monkeypatch, tmp_path, capsys):
    from tokenmill.bench import kernels
    from tokenmill.cli import build_parser
    from tokenmill.kernels.build import load

    if not load():
        pytest.skip("tokenmill's CPU kernels are not available here")
    monkeypatch.setattr(kernels, "resolve_bench_model", lambda model: tiny_model_dir)
    monkeypatch.setattr(kernels, "PROJECTION_ROWS", (1, 3))
    monkeypatch.setattr(kernels, "LAYER_GEMM_ROWS", (1, 5))
    monkeypatch.setattr(kernels, "MODEL_GEMM_ROWS", (1, 7))
    fast = kernels.best_seconds
    monkeypatch.setattr(kernels, "best_seconds", lambda fn, calls, repeats=7: fast(fn, 1, 1))
    out = tmp_path / "kernels.json"
    args = build_parser().parse_args(["bench", "kernels", "--batch", "4", "--json", str(out)])
    assert args.func(args) == 0
    assert "paged attention" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["read_bandwidth_gb_per_s"] > 0
    assert [a["sequences"] for a in report["attention"]] == [4, 4, 4, 4, 4]
    assert "int8" in report["attention"][3]["case"]
    assert all(a["ms"] > 0 and a["kv_gb_per_s"] > 0 for a in report["attention"])
    assert [p["rows"] for p in report["vocab_projection"]] == [1, 3]
    assert all(p[path] > 0 for p in report["vocab_projection"] for path in ("panel kernel", "oneDNN packed", "MKL"))
    assert [g["rows"] for g in report["layer_gemms"]] == [1, 5]
    assert all(
        g[path]["gflop_per_s"] > 0
        for g in report["layer_gemms"]
        for path in ("panel kernel", "panel int8", "oneDNN packed", "MKL")
    )
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert [(g["rows"], g["layers"]) for g in report["model_gemms"]] == [(1, layers), (7, layers)]
    assert all(
        g[panels]["ms"] > 0 and g[panels]["weight_gb_per_s"] > 0
        for g in report["model_gemms"]
        for panels in ("fp32", "bf16", "int8")
    )
