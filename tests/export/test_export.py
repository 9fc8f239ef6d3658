"""`tokenmill export`: the ONNX (onnxruntime) and TorchScript (torch.jit.load) decoder steps compute
tokenmill's logits and greedy tokens, on sharpened tiny models (see conftest.sharpen_weights)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.export.check import check_export
from tokenmill.export.decoder import load_exportable, past_names, present_names
from tokenmill.export.formats import export

CPU = torch.device("cpu")
# Longer than the Mistral fixture's 12-token window, so its generation runs past it.
LONG_PROMPT = "The mill by the river ground the wheat of every farm in the valley, day and night, for years"


def _export(model_dir: Path, fmt: str, out: Path) -> Path:
    export(load_exportable(model_dir, torch.float32, CPU), fmt, out, torch.float32, CPU, model_dir)
    return out


@pytest.fixture(scope="module")
def torchscript_dir(sharp_tiny_model_dir, tmp_path_factory) -> Path:
    return _export(sharp_tiny_model_dir, "torchscript", tmp_path_factory.mktemp("export-ts"))


@pytest.fixture(scope="module")
def onnx_dir(sharp_tiny_model_dir, tmp_path_factory) -> Path:
    return _export(sharp_tiny_model_dir, "onnx", tmp_path_factory.mktemp("export-onnx"))


def _assert_matches(report, new_tokens: int = 32) -> None:
    print(report.table())
    assert report.new_tokens == new_tokens and len(report.prompts) == 3
    for p in report.prompts:
        assert p.tokens_equal, report.table()  # 32 greedy tokens identical to tokenmill's
        assert p.batched_equal, report.table()  # and inside a left-padded batch of all three prompts
        assert p.max_logprob_diff <= 1e-4, report.table()
    assert report.passed


def test_torchscript_logits_and_greedy_tokens_equal_tokenmills(torchscript_dir, sharp_tiny_model_dir):
    _assert_matches(check_export(torchscript_dir, sharp_tiny_model_dir, CPU))


def test_onnx_logits_and_greedy_tokens_equal_tokenmills(onnx_dir, sharp_tiny_model_dir):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    outputs = {o.name: o.shape for o in session.get_outputs()}
    layers = 6
    assert list(inputs) == ["input_ids", "attention_mask", "position_ids", *past_names(layers)]
    assert list(outputs) == ["logits", *present_names(layers)]
    # Batch, new-token and past axes are symbolic; heads, head size and vocabulary fixed.
    assert inputs["input_ids"] == inputs["position_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"] == ["batch", "past_sequence + sequence"]
    assert inputs["past_key_values.0.key"] == ["batch", 2, "past_sequence", 64]
    assert outputs["logits"] == ["batch", "sequence", 49152]
    assert outputs["present.5.value"][0] == "batch" and isinstance(outputs["present.5.value"][2], str)
    _assert_matches(check_export(onnx_dir, sharp_tiny_model_dir, CPU))


def test_check_fails_for_another_models_export(torchscript_dir, tiny_model_dir, tmp_path):
    # The export of the sharpened weights, checked against the unsharpened model: logits differ.
    report = check_export(torchscript_dir, tiny_model_dir, CPU)
    assert not report.passed
    assert all(p.max_logprob_diff > 1e-2 for p in report.prompts)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_mistral_dir"])
def test_llama_family_exports_match(fixture, request, tmp_path):
    """Qwen2 (q/k/v biases, linear RoPE scaling) and Mistral (a sliding window shorter than the text)."""
    model_dir = request.getfixturevalue(fixture)
    out = _export(model_dir, "torchscript", tmp_path / "export")
    report = check_export(out, model_dir, CPU, prompts=[LONG_PROMPT, "Hello", "A mill"])
    _assert_matches(report)


@pytest.mark.slow
def test_cli_check_only_and_refusals(torchscript_dir, sharp_tiny_model_dir, tiny_gpt2_dir, tmp_path):
    copy = Path(shutil.copytree(torchscript_dir, tmp_path / "copy"))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "export",
            "--format",
            "torchscript",
            "--model",
            str(sharp_tiny_model_dir),
            str(copy),
            "--check-only",
            "--new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("PASS")
    assert "8 greedy tokens" in run.stdout
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "export",
            "--format",
            "onnx",
            "--model",
            str(tiny_gpt2_dir),
            str(tmp_path / "gpt2"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode == 2
    assert "export supports the native Llama-family architectures" in refused.stderr
    assert "Traceback" not in refused.stderr
