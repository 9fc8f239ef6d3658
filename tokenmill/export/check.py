"""`tokenmill export --check`: does the exported step compute what tokenmill's engine computes?

For a few prompts, tokenmill's engine (paged KV, continuous batching, its sampler) generates greedily
with the top-k log-probabilities of every step; the export then generates greedily through its own
past K/V, one prompt at a time and all prompts as one left-padded batch. The check passes when the
tokens are identical and every log-probability the engine reported (chosen token and top
alternatives, i.e. the logits up to each row's normalising constant) is within the tolerance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.export.formats import StepRunner, load_runner
from tokenmill.export.layout import MANIFEST

DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a mill by the river,")
TOP_LOGPROBS = 20
# Largest |log-probability difference| accepted: fp32 must match to 1e-4; half precision is rounded
# differently by each runtime's kernels.
TOLERANCE = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 1e-1}


@dataclass
class PromptCheck:
    prompt_tokens: int
    tokens_equal: bool  # the export's greedy tokens == the engine's
    batched_equal: bool  # the same inside a left-padded batch of all prompts
    max_logprob_diff: float  # over the steps before any token differs
    first_difference: int | None  # step of the first different token


@dataclass
class CheckReport:
    format: str
    dtype: str
    new_tokens: int
    tolerance: float
    prompts: list[PromptCheck]

    @property
    def passed(self) -> bool:
        return all(p.tokens_equal and p.batched_equal and p.max_logprob_diff <= self.tolerance for p in self.prompts)

    def table(self) -> str:
        lines = [
            f"{self.format} ({self.dtype}) vs tokenmill, {self.new_tokens} greedy tokens per prompt, "
            f"tolerance {self.tolerance:g}:",
            f"{'prompt':>6} {'tokens':>6} {'max |d logprob|':>16} {'greedy equal':>13} {'in a batch':>11}",
        ]
        for i, p in enumerate(self.prompts):
            lines.append(
                f"{i:>6} {p.prompt_tokens:>6} {p.max_logprob_diff:>16.2e} "
                f"{'yes' if p.tokens_equal else f'no (step {p.first_difference})':>13} "
                f"{'yes' if p.batched_equal else 'no':>11}"
            )
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def greedy(
    runner: StepRunner, prompts: list[list[int]], new_tokens: int, empty: list[torch.Tensor], pad_id: int = 0
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy tokens and each step's log-probabilities [vocab] of every prompt, run as one batch
    (left-padded to the longest prompt), feeding the presents back as the next step's past."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past = [e.expand(len(prompts), *e.shape[1:]).contiguous() for e in empty]
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        logits, past = runner(ids, mask, positions, past)
        step = torch.log_softmax(logits[:, -1].float(), dim=-1)
        chosen = step.argmax(-1)
        for row in range(len(prompts)):
            tokens[row].append(int(chosen[row]))
            logprobs[row].append(step[row])
        ids = chosen[:, None]
        positions = positions[:, -1:] + 1
        mask = torch.cat((mask, torch.ones(len(prompts), 1, dtype=mask.dtype)), dim=1)
    return tokens, logprobs


def check_export(
    out_dir: Path, model_dir: Path, device: torch.device, prompts: list[str] | None = None, new_tokens: int = 32
) -> CheckReport:
    from tokenmill import LLM, SamplingParams

    manifest = json.loads((out_dir / MANIFEST).read_text())
    dtype = manifest["dtype"]
    llm = LLM(str(model_dir), progress=False, dtype=dtype, device=device.type, kv_cache_memory="256MiB")
    try:
        prompt_ids = [llm.engine.input_processor.tokenize(p) for p in (prompts or DEFAULT_PROMPTS)]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
        reference = llm.generate(prompt_ids, params)
    finally:
        llm.engine.close()
    runner = load_runner(manifest["format"], out_dir, device)
    shape = (1, manifest["num_kv_heads"], 0, manifest["head_dim"])
    empty = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for _ in range(2 * manifest["num_layers"])]
    batched, _ = greedy(runner, prompt_ids, new_tokens, empty)
    checks = []
    for i, ids in enumerate(prompt_ids):
        (tokens,), (steps,) = greedy(runner, [ids], new_tokens, empty)
        ref = reference[i].outputs[0]
        differ = next((t for t, (a, b) in enumerate(zip(tokens, ref.token_ids)) if a != b), None)
        compared = len(tokens) if differ is None else differ + 1  # the first differing step's logits count too
        diff = 0.0
        for step, token, (chosen, top) in zip(steps[:compared], ref.token_ids, ref.logprobs):
            reported = {**top, token: chosen}  # the chosen token and the top alternatives
            diff = max(diff, *(abs(float(step[t]) - lp) for t, lp in reported.items() if math.isfinite(lp)))
        checks.append(
            PromptCheck(
                len(ids), differ is None and len(tokens) == len(ref.token_ids), batched[i] == tokens, diff, differ
            )
        )
    return CheckReport(manifest["format"], dtype, new_tokens, TOLERANCE[dtype], checks)
