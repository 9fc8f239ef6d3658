"""What a front end may ask of the engine it serves (vLLM's `EngineClient`): facts about the model,
requests in and outputs out, health and stats. `AsyncEngine` is one; the server types its engine
with this and nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.engine.outputs import RequestOutput, RequestOutputKind

if TYPE_CHECKING:
    from tokenmill.engine.detokenizer import TokenText
    from tokenmill.engine.input_processor import InputProcessor, PromptInput
    from tokenmill.engine.llm_engine import EngineStats, StepStats
    from tokenmill.engine.pooling_params import PoolingParams
    from tokenmill.engine.sampling_params import SamplingParams
    from tokenmill.lora.registry import LoRARegistry


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (None: token ids in and out)."""

    @property
    def token_text(self) -> TokenText | None:
        """Token id -> (text, bytes), for logprobs."""

    @property
    def input_processor(self) -> InputProcessor:
        """Chat rendering, tokenization and validation against the model (prompts are processed
        with it before `generate`, off the event loop)."""

    @property
    def model_name(self) -> str: ...

    @property
    def served_model_names(self) -> list[str]:
        """Every name requests may give the base model (--served-model-name); model_name is the first."""

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling settings of requests that leave them unset (--generation-config), by SamplingParams name."""

    @property
    def loras(self) -> LoRARegistry | None:
        """The LoRA adapters requests may name (None: LoRA is off)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def hidden_size(self) -> int:
        """The length of an embedding."""

    def generate(
        self,
        prompt: str | list[int] | PromptInput,
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; closing the iterator early aborts it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_alive(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """`listener` runs on the engine thread after every step."""

    def shutdown(self) -> None: ...
