"""Memory and batch-1 decode speed of 8-bit checkpoints against the float model they come from.

The default model is written as llm-compressor's compressed-tensors exports would publish it, by the
compressed-tensors library itself (its quantization schemes, scales and compressors: `pip install
compressed-tensors`, the `bench` extra): W8A16 (int8 weights, a scale per output channel),
W8A8 (the same weights, activations rounded to int8 per token at run time) and FP8 (e4m3 weights
per channel, FP8_DYNAMIC); the lm_head stays in the checkpoint's dtype, as llm-compressor's recipes
leave it. Each variant then runs `tokenmill bench offline --roofline --skip-main` in a process of its
own (the bytes of weights held, the bytes a batch-1 step streams, and the best batch-1 step against
the bound those bytes and the copy bandwidth set), next to the float model in fp32 and bf16 and to
`--quantization int8`.

    python bench/eight_bit_checkpoints.py --json bench/results/eight-bit-checkpoints.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, compressed-tensors scheme or None for the float checkpoint, tokenmill flags)
VARIANTS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("fp32", None, ("--dtype", "float32")),
    ("bf16", None, ("--dtype", "bfloat16")),
    ("int8 (--quantization int8)", None, ("--dtype", "float32", "--quantization", "int8")),
    ("W8A16, fp32 activations", "W8A16", ("--dtype", "float32")),
    ("W8A16, bf16 activations", "W8A16", ("--dtype", "bfloat16")),
    ("W8A8, fp32 activations", "W8A8", ("--dtype", "float32")),
    ("W8A8, bf16 activations", "W8A8", ("--dtype", "bfloat16")),
    ("FP8, fp32 activations", "FP8_DYNAMIC", ("--dtype", "float32")),
    ("FP8, bf16 activations", "FP8_DYNAMIC", ("--dtype", "bfloat16")),
)


def write_compressed(source: Path, target: Path, scheme_name: str) -> Path:
    """`source` (an HF checkpoint) quantized by compressed-tensors' `scheme_name` preset (weights per
    output channel) and saved compressed, as llm-compressor saves it."""
    import torch
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    scheme.weights.strategy, scheme.weights.group_size = "channel", None  # (SmolLM2's 576 inputs: no groups of 128)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            weight = module.weight.float()
            zeros = torch.zeros(weight.shape[0], 1)
            scale, zero_point = calculate_qparams(
                torch.minimum(weight.amin(dim=1, keepdim=True), zeros),
                torch.maximum(weight.amax(dim=1, keepdim=True), zeros),
                module.quantization_scheme.weights,
            )
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero_point)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def run_roofline(model: Path, flags: tuple[str, ...], output: Path) -> dict:
    """The roofline result of one fresh process."""
    command = [sys.executable, "-m", "tokenmill.cli", "bench", "offline", "--roofline", "--skip-main"]
    command += ["--model", str(model), *flags, "--no-progress", "--json", str(output)]
    done = subprocess.run(command, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode})")
    return json.loads(output.read_text())["roofline"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an HF checkpoint directory (default: the bundled model)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    from tokenmill.bench.report import environment
    from tokenmill.models.model_loader.hub import default_model_dir

    source = Path(args.model) if args.model else default_model_dir()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        written: dict[str, Path] = {}
        for name, scheme, flags in VARIANTS:
            model = source
            if scheme is not None:
                if scheme not in written:
                    written[scheme] = write_compressed(source, Path(tmp) / scheme, scheme)
                model = written[scheme]
            roofline = run_roofline(model, flags, Path(tmp) / "roofline.json")
            row = {
                "variant": name,
                "scheme": scheme,
                "flags": list(flags),
                "param_bytes": roofline["param_bytes"],
                "weight_bytes": roofline["weight_bytes"],
                "measured_step_s": roofline["measured_step_s"],
                "bound_step_s": roofline["bound_step_s"],
                "ratio": roofline["ratio"],
                "bandwidth_gbs": roofline["bandwidth_gbs"],
            }
            rows.append(row)
            print(
                f"{name:28s} weights held {row['param_bytes'] / 1e6:7.1f} MB, "
                f"streamed {row['weight_bytes'] / 1e6:7.1f} MB  "
                f"step {row['measured_step_s'] * 1e3:6.2f} ms  ({row['ratio']:.2f}x the bound)",
                flush=True,
            )
    env = {**environment(), "command": shlex.join(["python", *sys.argv])}
    result = {"environment": env, "model_dir": str(source), "rows": rows}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
