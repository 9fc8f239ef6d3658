"""How far int8 weights can agree with a bf16 model: teacher-forced top-1 agreement (the text and
chunks of `tokenmill bench agreement`) of the default model (SmolLM2, Llama) run in Hugging Face's
bf16 arithmetic (every op's output rounded to bf16, GEMMs summed in fp32), with its logits rounded
to bf16 or kept fp32, over four sets of linear weights: the checkpoint's rounded to bf16 (the bf16
model: the reference), the checkpoint's exact fp32 values (what a perfect int8 scheme could give at
best), and int8 in groups of 32 by round-to-nearest and by tokenmill's least-error scales
(tokenmill.models.layers.quantization.int8, dequantized exactly). A plain fp32 model is the other reference. Each
model is a plain torch forward here, not the engine: it isolates the weights from tokenmill's
kernels. (It runs for minutes on a small CPU.)

    python bench/int8_agreement_ceiling.py [--tokens 2048] [--chunk 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from tokenmill.bench.agreement import TEXT_SOURCE, text_chunks
from tokenmill.bench.report import environment
from tokenmill.models.layers.quantization.int8 import group_scales, quantize_weight
from tokenmill.models.model_loader.hub import resolve_model

Weights = dict[str, torch.Tensor]


class Llama:
    """A Llama forward over `weights` (fp32 tensors), every op's output rounded to bf16 (`bf16`) or
    nothing rounded, the GEMMs' inputs rounded to bf16 with `bf16`, and the logits kept fp32 or not."""

    def __init__(self, model_dir: str) -> None:
        self.config = AutoConfig.from_pretrained(model_dir)
        if self.config.model_type != "llama":
            raise SystemExit(f"this emulation runs Llama models; {model_dir} is {self.config.model_type}")
        self.state = load_file(sorted(Path(model_dir).glob("*.safetensors"))[0])  # (one file: SmolLM2)
        c = self.config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def linear_names(self) -> list[str]:
        return [k for k in self.state if k.endswith("proj.weight")] + [self.head_name()]

    def head_name(self) -> str:
        return "lm_head.weight" if "lm_head.weight" in self.state else "model.embed_tokens.weight"

    def forward(self, ids: torch.Tensor, weights: Weights, bf16: bool, fp32_logits: bool) -> torch.Tensor:
        c, d = self.config, self.head_dim
        heads, kv_heads, n = c.num_attention_heads, c.num_key_value_heads, len(ids)

        def r(x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.bfloat16).float() if bf16 else x

        def rms(x: torch.Tensor, name: str) -> torch.Tensor:
            y = r(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps))
            return r(r(self.state[name]) * y)

        def linear(x: torch.Tensor, name: str) -> torch.Tensor:
            return r(F.linear(r(x), weights[name]))

        def rope(x: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

        angles = torch.outer(torch.arange(n).float(), self.inv_freq)
        cos, sin = r(torch.cat([angles, angles], -1).cos()), r(torch.cat([angles, angles], -1).sin())
        mask = torch.full((n, n), float("-inf")).triu(1)
        x = r(self.state["model.embed_tokens.weight"][ids])
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms(x, p + "input_layernorm.weight")
            q = linear(h, p + "self_attn.q_proj.weight").view(n, heads, d).transpose(0, 1)
            k = linear(h, p + "self_attn.k_proj.weight").view(n, kv_heads, d).transpose(0, 1)
            v = linear(h, p + "self_attn.v_proj.weight").view(n, kv_heads, d).transpose(0, 1)
            q, k = r(rope(q)), r(rope(k))
            k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
            probs = r(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + mask, -1))
            attended = r(probs @ v).transpose(0, 1).reshape(n, heads * d)
            x = r(x + linear(attended, p + "self_attn.o_proj.weight"))
            h = rms(x, p + "post_attention_layernorm.weight")
            mixed = r(r(F.silu(linear(h, p + "mlp.gate_proj.weight"))) * linear(h, p + "mlp.up_proj.weight"))
            x = r(x + linear(mixed, p + "mlp.down_proj.weight"))
        logits = F.linear(r(rms(x, "model.norm.weight")), weights[self.head_name()])
        return logits if fp32_logits or not bf16 else r(logits)


def int8_weights(weights: Weights, scales: Callable[[torch.Tensor], torch.Tensor] | None) -> Weights:
    """Each weight through int8 in groups of 32 (tokenmill's scales, or `scales`), dequantized in fp32."""
    out = {}
    for name, w in weights.items():
        if scales is None:
            q, s = quantize_weight(w, 32)
        else:
            s = scales(w.reshape(-1, 32)).view(w.shape[0], -1)
            q = torch.round(w.view(w.shape[0], -1, 32) / s.float()[..., None]).clamp(-127, 127)
        out[name] = (q.float().view(w.shape[0], -1, 32) * s.float()[..., None]).view(w.shape)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="teacher-forced positions (default: 2048)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward pass (default: 256)")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model_dir = str(resolve_model(None))
    model = Llama(model_dir)
    chunks = text_chunks(AutoTokenizer.from_pretrained(model_dir), args.tokens, args.chunk)

    def top1(weights: Weights, bf16: bool, fp32_logits: bool = True) -> torch.Tensor:
        return torch.cat([model.forward(torch.tensor(c), weights, bf16, fp32_logits).argmax(-1) for c in chunks])

    exact = {name: model.state[name].float() for name in model.linear_names()}
    weight_sets = {
        "bf16 (the checkpoint rounded to bf16)": {k: w.to(torch.bfloat16).float() for k, w in exact.items()},
        "exact (the checkpoint's fp32 values)": exact,
        "int8, round to nearest": int8_weights(exact, lambda g: group_scales(g, 1)),
        "int8, least-error scales (tokenmill)": int8_weights(exact, None),
    }
    fp32 = top1(exact, bf16=False)
    rows = []
    for fp32_logits in (False, True):
        reference = top1(weight_sets["bf16 (the checkpoint rounded to bf16)"], True, fp32_logits)
        for label, weights in weight_sets.items():
            got = reference if label.startswith("bf16") else top1(weights, True, fp32_logits)
            row = {
                "logits": "fp32" if fp32_logits else "bf16",
                "weights": label,
                "with_bf16": float((got == reference).float().mean()),
                "with_fp32": float((got == fp32).float().mean()),
            }
            rows.append(row)
            print(
                f"{row['logits']} logits | {label:40s} | with the bf16 model {100 * row['with_bf16']:6.2f}% "
                f"| with fp32 {100 * row['with_fp32']:6.2f}%",
                flush=True,
            )
    if args.json:
        env = {**environment(), "command": shlex.join(["python", *sys.argv])}
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "text": TEXT_SOURCE, "tokens": args.tokens, "chunk": args.chunk, "rows": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
