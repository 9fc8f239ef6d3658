"""`bench offline --compare hf`: the naive baseline, Hugging Face `generate` on consecutive static
left-padded batches that each decode to their longest request's output length."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.bench.offline.runners import RunResult, run_result
from tokenmill.bench.offline.workload import OfflineRequest
from tokenmill.bench.sampling import GREEDY, Sampling


def static_batches(workload: Sequence[OfflineRequest], batch_size: int) -> list[list[int]]:
    """Indices of consecutive requests, `batch_size` at a time (arrival order, like a naive server)."""
    return [list(range(i, min(i + batch_size, len(workload)))) for i in range(0, len(workload), batch_size)]


def padding_accounting(workload: Sequence[OfflineRequest], batch_size: int) -> tuple[int, int, float]:
    """(useful tokens, generated tokens, waste fraction) of static batches that each decode to their
    longest request's output length."""
    useful = sum(r.output_len for r in workload)
    generated = sum(len(b) * max(workload[i].output_len for i in b) for b in static_batches(workload, batch_size))
    return useful, generated, (1.0 - useful / generated) if generated else 0.0


def load_hf_model(model_dir: str | Path, device: str = "cpu", dtype: Any = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    # (Any: transformers declares `PreTrainedModel.to` through a wrapper that type checkers read as unbound.)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    return model.to(device).eval()


def _hf_generate(
    model: Any, prompts: Sequence[list[int]], new_tokens: int, pad_id: int, sampling: Sampling = GREEDY
) -> list[list[int]]:
    """`generate` (greedy, or sampled as `sampling` says) on one left-padded batch that decodes
    exactly `new_tokens` for every row."""
    import copy

    import torch

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    # ignore_eos semantics: no EOS id at all, so nothing stops early and no logit is suppressed
    # (min_new_tokens with an EOS id would mask EOS and change greedy picks vs tokenmill).
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.eos_token_id = None
    gen_config.pad_token_id = pad_id
    gen_config.do_sample = not sampling.greedy
    gen_config.max_new_tokens = new_tokens
    gen_config.min_new_tokens = new_tokens
    for name in ("temperature", "top_p", "top_k", "min_p"):  # greedy: no warning about unused sampling flags
        setattr(gen_config, name, None if sampling.greedy else getattr(sampling, name))
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_config)
    gen = out[:, width:].tolist()
    if any(len(g) != new_tokens for g in gen):
        raise RuntimeError(f"HF generate returned {len(gen[0])} tokens, expected {new_tokens}")
    return gen


def hf_pad_id(model_dir: str | Path) -> int:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        for value in (tok.pad_token_id, tok.eos_token_id):
            if value is not None:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def run_hf_static(
    model: Any,
    workload: Sequence[OfflineRequest],
    batch_size: int = 16,
    pad_id: int = 0,
    progress: bool = True,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """The naive baseline: consecutive static batches, each decoding to its longest output length.

    Useful tokens are each request's own output length (the rest of its row is waste); a request's
    latency is when its batch ends, since all arrive at t=0. TTFT is not observable through
    `generate` (nothing streams out), so it is left NaN.
    """
    from tqdm.auto import tqdm

    token_ids: list[list[int]] = [[] for _ in workload]
    latencies = [0.0] * len(workload)
    batches = static_batches(workload, batch_size)
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="HF static batches", unit="batch", disable=not progress):
        longest = max(workload[i].output_len for i in batch)
        gen = _hf_generate(model, [workload[i].prompt_token_ids for i in batch], longest, pad_id, sampling)
        end = time.perf_counter() - t0
        for row, i in enumerate(batch):
            token_ids[i] = gen[row][: workload[i].output_len]
            latencies[i] = end
    duration = time.perf_counter() - t0
    _, generated, waste = padding_accounting(workload, batch_size)
    return run_result(
        f"hf-static-bs{batch_size}",
        workload,
        token_ids,
        duration,
        latencies,
        [],
        max_num_seqs=batch_size,
        generated_tokens=generated,
        padding_waste=waste,
    )


def hf_baseline_run(
    model_dir: Path,
    workload: Sequence[OfflineRequest],
    batch_size: int,
    dtype: str,
    device: str,
    progress: bool,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """Load the HF model, warm it up untimed and run the static-batch baseline."""
    import torch

    hf = load_hf_model(model_dir, device=device, dtype=getattr(torch, dtype))
    pad = hf_pad_id(model_dir)
    _hf_generate(hf, [workload[0].prompt_token_ids], 4, pad, sampling)  # untimed warmup
    return run_hf_static(hf, workload, batch_size, pad, progress=progress, sampling=sampling)
