"""Writing the decoder step as ONNX (torch.onnx, dynamo exporter) or TorchScript (torch.jit.trace),
and running what was written (onnxruntime / torch.jit.load) with the same call."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from tokenmill.export.decoder import INPUTS, ExportDecoder, past_names, present_names
from tokenmill.export.layout import FILES, MANIFEST

# What a runtime needs beside the graph: the tokenizer, the config (eos ids), the generation config.
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def example_inputs(decoder: ExportDecoder, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A step of 2 rows x 3 new tokens after 2 past ones: every axis longer than 1, so tracing keeps them symbolic."""
    spec = decoder.model.spec
    batch, seq, past = 2, 3, 2
    ids = torch.randint(0, spec.vocab_size, (batch, seq), device=device)
    mask = torch.ones(batch, past + seq, dtype=torch.long, device=device)
    positions = torch.arange(past, past + seq, device=device).expand(batch, seq)
    kv = [
        torch.randn(batch, spec.num_kv_heads, past, spec.head_dim, dtype=dtype, device=device)
        for _ in range(2 * decoder.num_layers)
    ]
    return (ids, mask, positions, *kv)


def export(
    decoder: ExportDecoder, fmt: str, out_dir: Path, dtype: torch.dtype, device: torch.device, model_dir: Path
) -> Path:
    """Write the graph, its manifest and the model's tokenizer/config files to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / FILES[fmt]
    args = example_inputs(decoder, dtype, device)
    with torch.inference_mode(False), torch.no_grad():
        if fmt == "onnx":
            _export_onnx(decoder, args, path)
        else:
            _export_torchscript(decoder, args, path)
    for name in _COPIED:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out_dir / name)
    spec = decoder.model.spec
    manifest = {
        "format": fmt,
        "file": path.name,
        "dtype": str(dtype).removeprefix("torch."),
        "model_type": spec.model_type,
        "num_layers": decoder.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position": spec.context_len or spec.max_position,
        "eos_token_ids": spec.eos_token_ids,
        "inputs": [*INPUTS, *past_names(decoder.num_layers)],
        "outputs": ["logits", *present_names(decoder.num_layers)],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def _export_onnx(decoder: ExportDecoder, args: tuple[torch.Tensor, ...], path: Path) -> None:
    import onnx_ir as ir

    # Every axis but heads / head size / vocab is dynamic: batch, new tokens, past tokens. One
    # symbol per axis kind (the attention mask's length, past + new, is left to export to derive):
    # separate symbols per tensor would make its shape reasoning minutes slower.
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("sequence"), torch.export.Dim("past_sequence")
    # (*past is one argument to torch.export: its shapes are one tuple.)
    shapes = (
        {0: batch, 1: seq},
        {0: batch, 1: torch.export.Dim.AUTO},
        {0: batch, 1: seq},
        tuple({0: batch, 2: past} for _ in args[3:]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # axis names shared by several inputs, said once per input
        program = torch.onnx.export(
            decoder,
            args,
            dynamo=True,
            dynamic_shapes=shapes,
            input_names=[*INPUTS, *past_names(decoder.num_layers)],
            output_names=["logits", *present_names(decoder.num_layers)],
            optimize=False,
            verbose=False,
        )
    if program is None:  # (only the legacy exporter, dynamo=False, returns none)
        raise RuntimeError("torch.onnx.export returned no ONNX program")
    mask = program.model.graph.inputs[1]  # its length axis got a generated name: call it what it is
    if mask.shape is None:
        raise RuntimeError("the exported ONNX graph's attention_mask input has no shape")
    mask.shape = ir.Shape([mask.shape[0], "past_sequence + sequence"])
    program.save(str(path))


def _export_torchscript(decoder: ExportDecoder, args: tuple[torch.Tensor, ...], path: Path) -> None:
    with warnings.catch_warnings():
        # The tracer warns about the Python ints of shapes; every shape here comes from an input's
        # size, which it records symbolically (the parity check runs other shapes than the example).
        # torch 2.13 also marks TorchScript deprecated (it is what libtorch loads).
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(decoder, args, check_trace=False)
    traced.save(str(path))


# ---------------------------------------------------------------------------------------------- running


class StepRunner(Protocol):
    """An exported decoder step: (input_ids, attention_mask, position_ids, past) -> (logits, presents)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: list[torch.Tensor],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]: ...


class OnnxRunner:
    def __init__(self, path: Path, device: torch.device) -> None:
        import onnxruntime

        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = onnxruntime.InferenceSession(str(path), providers=providers)
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, input_ids, attention_mask, position_ids, past):
        values = [input_ids, attention_mask, position_ids, *past]
        feeds = {name: v.cpu().numpy() for name, v in zip(self.input_names, values, strict=True)}
        logits, *presents = self.session.run(None, feeds)
        return torch.from_numpy(logits), [torch.from_numpy(p) for p in presents]


class TorchScriptRunner:
    def __init__(self, path: Path, device: torch.device) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (torch 2.13: TorchScript is deprecated)
            self.module = torch.jit.load(str(path), map_location=device)
        self.device = device

    def __call__(self, input_ids, attention_mask, position_ids, past):
        with torch.inference_mode():
            logits, *presents = self.module(
                input_ids.to(self.device),
                attention_mask.to(self.device),
                position_ids.to(self.device),
                *(p.to(self.device) for p in past),
            )
        return logits.cpu(), list(presents)


def load_runner(fmt: str, out_dir: Path, device: torch.device) -> StepRunner:
    runner: Any = OnnxRunner if fmt == "onnx" else TorchScriptRunner
    return runner(out_dir / FILES[fmt], device)
