"""Speculative decoding: cheap guesses of a sequence's next tokens, verified by the model in one
forward pass.

Where each part lives: proposals come from `ngram` (n-gram prompt lookup, at scheduling) or `draft`
(a small draft model, right after scheduling); the scheduler budgets and allocates the drafts and
lands the accepted ones (`engine/core/scheduler.py`); the runner runs each speculating sequence's next
token and drafts as one chunk (`engine/worker/model_runner.py`); the sampler verifies them by rejection
sampling (`engine/sample/sampler.py`).
"""

from __future__ import annotations

from tokenmill.engine.config import EngineConfig


def check_speculative_config(config: EngineConfig) -> None:
    """Refuse speculative settings that cannot work, naming the flag."""
    method = config.speculative_method
    if method != "draft" and config.speculative_model:
        raise ValueError("--speculative-model needs --speculative-method draft")
    if method is None:
        return
    if config.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {config.num_speculative_tokens}")
    if method == "ngram" and not 1 <= config.ngram_prompt_lookup_min <= config.ngram_prompt_lookup_max:
        raise ValueError(
            "--ngram-prompt-lookup-min must be >= 1 and at most --ngram-prompt-lookup-max, got "
            f"{config.ngram_prompt_lookup_min} and {config.ngram_prompt_lookup_max}"
        )
    if method == "draft":
        if not config.speculative_model:
            raise ValueError("--speculative-method draft needs --speculative-model DIR (the draft model)")
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-method draft does not run with --tensor-parallel-size > 1; "
                "--speculative-method ngram does"
            )
