"""Speculative decoding in `tokenmill bench features`: requests one at a time (batch size 1, the
latency case speculation is for), on a repetitive workload (rewrite a piece of code with one small
change: most of the answer is in the prompt, so n-gram lookup finds it) and a non-repetitive one
(free text), each with speculation off and on. Reported besides tok/s: the share of draft tokens
the model accepted and the mean tokens per verification step."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.offline.runners import RunResult, run_result
from tokenmill.bench.offline.workload import OfflineRequest

_SNIPPETS = [
    '''def moving_average(values, window):
    """The mean of every run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages''',
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise KeyError(f"not enough {name} in stock")
        self.items[name] -= count
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())""",
    """def parse_config(lines):
    config = {}
    section = None
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            config[section] = {}
        elif "=" in line and section is not None:
            key, value = line.split("=", 1)
            config[section][key.strip()] = value.strip()
    return config""",
    """def binary_search(sorted_values, target):
    low, high = 0, len(sorted_values) - 1
    while low <= high:
        middle = (low + high) // 2
        if sorted_values[middle] == target:
            return middle
        if sorted_values[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1""",
]
_CHANGES = [
    "Add type hints to every parameter",
    "Rename the first parameter to `data`",
    "Add a docstring at the top",
    "Replace the double quotes with single quotes",
]
_FREE_TEXT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, for a curious twelve-year-old.",
    "Describe a walk through a busy market in Marrakech at dusk.",
    "What are the trade-offs between renting and buying a home?",
]

BS1_WORKLOADS = ("rewrite code (bs1)", "free text (bs1)")


def bs1_workloads(tokenizer: Any, num_prompts: int, max_output: int) -> dict[str, list[OfflineRequest]]:
    """The two workloads as chat prompts of the model's template (plain text without one)."""
    rewrite = [
        f"{_CHANGES[i % len(_CHANGES)]}, and change nothing else. Answer with the whole code.\n\n```python\n"
        f"{_SNIPPETS[i % len(_SNIPPETS)]}\n```"
        for i in range(num_prompts)
    ]
    free = [_FREE_TEXT[i % len(_FREE_TEXT)] for i in range(num_prompts)]

    def tokens(text: str) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return tokenizer.encode(text)

    return {
        name: [OfflineRequest(tokens(t), max_output) for t in texts]
        for name, texts in zip(BS1_WORKLOADS, (rewrite, free))
    }


@dataclass
class Bs1Result:
    run: RunResult
    acceptance_rate: float | None  # accepted / proposed draft tokens (None: nothing proposed)
    mean_accepted_length: float | None  # tokens per verification step


def bs1_run(kwargs: dict[str, Any], workload: Sequence[OfflineRequest], name: str, progress: bool) -> Bs1Result:
    """Build the engine, warm it up untimed, then time each request alone (greedy, stopping at EOS
    as a user's request would)."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.roofline import model_weight_bytes

    kwargs = dict(kwargs)
    llm = LLM(kwargs.pop("model"), progress=progress, **kwargs)
    try:
        llm.generate([workload[0].prompt_token_ids], SamplingParams(temperature=0, max_tokens=8))
        before = llm.engine.stats()
        token_ids, latencies, ttfts = [], [], []
        start = time.perf_counter()
        for request in workload:
            out = llm.generate(
                [request.prompt_token_ids], SamplingParams(temperature=0, max_tokens=request.output_len)
            )[0]
            token_ids.append(list(out.outputs[0].token_ids))
            latencies.append(out.metrics.finished_time - out.metrics.arrival_time)
            ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        duration = time.perf_counter() - start
        after = llm.engine.stats()
        run = run_result(name, workload, token_ids, duration, latencies, ttfts, max_num_seqs=1)
        run.weight_bytes = model_weight_bytes(llm.engine.model)[0]
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        return Bs1Result(run, accepted / proposed if proposed else None, 1 + accepted / drafts if drafts else None)
    finally:
        llm.engine.close()
