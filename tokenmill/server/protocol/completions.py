"""/v1/completions: the request, the response and its stream chunks."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
)

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol.base import ChoicesEnvelope, as_batch, not_supported_yet
from tokenmill.server.protocol.sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' first)
    suffix: str | None = not_supported_yet()

    def check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must be equal to n (or unset)", param="best_of")
        self.check_prompt_logprobs()

    def engine_prompt_logprobs(self, max_tokens: int) -> int | None:
        """The prompt logprobs the engine computes: what echo with logprobs shows and what
        prompt_logprobs asks for (the larger top count serves both); max_tokens 0 with echo scores
        the prompt even without logprobs (the engine's prefill-only requests are scoring requests)."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        if wanted:
            return max(wanted)
        if max_tokens == 0:
            if not self.echo:
                raise bad_request(
                    "max_tokens must be at least 1 (0 only with echo or prompt_logprobs: score the "
                    "prompt without generating)",
                    param="max_tokens",
                )
            return 0
        return None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a single string/token list becomes a batch of one."""
        return as_batch(self.prompt, "prompt")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # With echo, the first prompt token's entries are null (nothing precedes it), as OpenAI sends them.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: PromptLogprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra, when asked for


class CompletionResponse(ChoicesEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionChunk(CompletionResponse):
    """A streamed piece of a completion: OpenAI sends it in the response's own shape."""
