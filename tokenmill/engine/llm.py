"""Offline batch API, like vLLM's `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import cast

from tqdm.auto import tqdm

from tokenmill.engine.config import OFFLINE_DEFAULTS, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.lora.registry import LoRARequest
from tokenmill.lora.types import LoRAAdapter

LoRAChoice = LoRARequest | Seq[LoRARequest | None] | None


class LLM:
    def __init__(self, model: str | None = None, progress: bool = True, **engine_args) -> None:
        config = EngineConfig(model=model, **{**OFFLINE_DEFAULTS, **engine_args})
        self.engine = LLMEngine(config, progress=progress)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRAChoice = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.
        `lora_request` (vLLM's): the LoRA adapter of every prompt, or one per prompt (None: the base
        model); needs `enable_lora=True`, loads the adapter on first use. `priority` (vLLM's): one per
        prompt, lower first; needs `scheduling_policy="priority"`."""
        params = sampling_params or self.engine.default_sampling_params()  # (the model's generation defaults)
        return self._run(prompts, params, use_tqdm, "Generating", lora_request, priority)

    def embed(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
        lora_request: LoRAChoice = None,
    ) -> list[list[float]]:
        """The pooled final hidden state of each prompt (last-token, L2-normalised by default)."""
        outputs = self._run(prompts, pooling_params or PoolingParams(), use_tqdm, "Embedding", lora_request)
        return [_embedding(o) for o in outputs]

    def _run(
        self,
        prompts: str | Seq[str] | Seq[int] | Seq[list[int]],
        params: SamplingParams | PoolingParams | Seq[SamplingParams | PoolingParams],
        use_tqdm: bool,
        desc: str,
        lora_request: LoRAChoice = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _prompt_list(prompts)
        params_list = (
            list(params)
            if isinstance(params, (list, tuple))
            else [cast("SamplingParams | PoolingParams", params)] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError("give one set of params, or one per prompt")
        adapters = self._adapters(lora_request, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError("give one priority per prompt")
        # Validate everything before anything runs, so a bad prompt cannot leave others half done.
        requests = [
            self.engine.make_request(
                f"offline-{id(self)}-{i}",
                p,
                sp,
                output_kind=RequestOutputKind.FINAL_ONLY,
                lora=adapter,
                priority=rank,
            )
            for i, (p, sp, adapter, rank) in enumerate(zip(prompt_list, params_list, adapters, priorities))
        ]
        for request in requests:
            self.engine.add(request)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc=desc, disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        return [done[r.request_id] for r in requests]

    def _adapters(self, lora_request: LoRAChoice, count: int) -> list[LoRAAdapter | None]:
        requests: list[LoRARequest | None] = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else [cast("LoRARequest | None", lora_request)] * count
        )
        if len(requests) != count:
            raise ValueError("give one lora_request, or one per prompt")
        loras = self.engine.loras
        if loras is None:
            if any(r is not None for r in requests):
                raise ValueError("lora_request needs an LLM built with enable_lora=True")
            return [None] * count
        return [None if r is None else loras.get_or_load(r) for r in requests]


def _prompt_list(prompts: str | Seq[str] | Seq[int] | Seq[list[int]]) -> list[str | Seq[int]]:
    """One prompt (text, or token ids) or several."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [cast("str | Seq[int]", prompts)]
    return list(cast("Seq[str | list[int]]", prompts))


def _embedding(out: RequestOutput) -> list[float]:
    assert out.embedding is not None, "an embedding request's final output carries its vector"
    return out.embedding
