"""`bench offline`'s workload: seeded token-id prompts of mixed lengths, each with its own output
length, and the JSON schema of `--compare structured-output`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Token ids for synthetic prompts start here: SmolLM2's special tokens all sit below 100.
MIN_PROMPT_TOKEN_ID = 100


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(
    num_prompts: int, min_input: int, max_input: int, min_output: int, max_output: int, vocab_size: int, seed: int = 0
) -> list[OfflineRequest]:
    """Token-id prompts with lengths uniform in [min_input, max_input] and output lengths uniform in
    [min_output, max_output] (inclusive), deterministic for a seed."""
    if not 1 <= min_input <= max_input:
        raise ValueError(f"need 1 <= --min-input <= --max-input, got {min_input}, {max_input}")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"need 1 <= --min-output <= --max-output, got {min_output}, {max_output}")
    low = MIN_PROMPT_TOKEN_ID if vocab_size > 2 * MIN_PROMPT_TOKEN_ID else 0
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(min_input, max_input + 1, size=num_prompts)
    out_lens = rng.integers(min_output, max_output + 1, size=num_prompts)
    return [
        OfflineRequest(rng.integers(low, vocab_size, size=int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def describe_workload(workload: Sequence[OfflineRequest]) -> str:
    ins = [len(r.prompt_token_ids) for r in workload]
    outs = [r.output_len for r in workload]
    return (
        f"{len(workload)} requests, prompt tokens {min(ins)}-{max(ins)} (sum {sum(ins)}), "
        f"output tokens {min(outs)}-{max(outs)} (sum {sum(outs)})"
    )


# `--compare structured-output`: records of every kind of JSON value. minItems keeps each document
# open past any --max-output, so the constrained run produces exactly the tokens the free run does.
_RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "done": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "score", "tags", "done"],
    "additionalProperties": False,
}

STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": _RECORD, "minItems": 256}},
    "required": ["items"],
    "additionalProperties": False,
}
