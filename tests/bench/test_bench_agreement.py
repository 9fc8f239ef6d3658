"""`tokenmill bench agreement`: teacher-forced top-1 agreement on real text."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench import agreement


@pytest.mark.slow
@pytest.mark.engine
def test_agreement_of_a_setting_with_itself_is_total_and_int8_is_measured(tiny_model_dir, monkeypatch, tmp_path):
    from tokenmill.cli import build_parser

    monkeypatch.setattr(agreement, "resolve_bench_model", lambda model: tiny_model_dir)
    args = build_parser().parse_args(
        [
            "bench",
            "agreement",
            "--tokens",
            "96",
            "--chunk",
            "40",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "16MiB",
            "--no-progress",
        ]
    )
    setting, (same,) = agreement.measure(args)
    assert (same.reference, same.tokens, same.top1_agreement) == ("float32", 96, 1.0)  # deterministic
    out = tmp_path / "agreement.json"
    args = build_parser().parse_args(
        [
            "bench",
            "agreement",
            "--tokens",
            "96",
            "--chunk",
            "40",
            "--quantization",
            "int8",
            "--references",
            "float32",
            "bfloat16",
            "--kv-cache-memory",
            "16MiB",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert "quantization int8" in report["setting"]
    assert [r["reference"] for r in report["results"]] == ["float32", "bfloat16"]
    assert all(0.5 < r["top1_agreement"] <= 1.0 and r["tokens"] == 96 for r in report["results"])


def test_chunks_are_real_text(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    chunks = agreement.text_chunks(tokenizer, 300, 128)
    assert [len(c) for c in chunks] == [128, 128, 44]
    text = tokenizer.decode([t for c in chunks for t in c])
    assert sum(word in text.split() for word in ("the", "a", "is", "of")) >= 3  # English prose


@pytest.mark.slow
@pytest.mark.engine
def test_step_reads_keys_back_from_a_narrower_kv_cache(tiny_model_dir, monkeypatch):
    """--step: positions in passes that read their keys from the KV cache. With the model's own KV
    dtype the predictions equal one prefill's; with --kv-cache-dtype bfloat16 they see rounded K/V,
    and the references keep the full-width cache."""
    import torch

    from tokenmill.bench.engine_args import make_llm
    from tokenmill.cli import build_parser

    monkeypatch.setattr(agreement, "resolve_bench_model", lambda model: tiny_model_dir)
    base = [
        "bench",
        "agreement",
        "--tokens",
        "64",
        "--chunk",
        "32",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--no-progress",
    ]
    args = build_parser().parse_args(base)
    llm = make_llm(args, tiny_model_dir)
    chunks = [list(range(100, 132)), list(range(300, 332))]
    one_prefill = agreement.predictions(llm, chunks)
    assert torch.equal(agreement.predictions(llm, chunks, step=5), one_prefill)
    llm.engine.close()
    setting, (result,) = agreement.measure(
        build_parser().parse_args(base + ["--step", "4", "--kv-cache-dtype", "bfloat16"])
    )
    assert "KV cache bfloat16" in setting and result.reference == "float32" and 0.5 < result.top1_agreement <= 1.0
