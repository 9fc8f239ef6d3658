"""/v1/embeddings: the request and the response."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
)

from tokenmill.server.protocol.base import NullMeansDefault, as_batch, ignored


class EmbeddingRequest(NullMeansDefault):
    """OpenAI's /v1/embeddings body, plus tokenmill's pooling extras."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # only the model's own hidden size (no truncation)
    user: str | None = ignored("end-user ids are only logged with --log-prompts")
    # Extras: override the server's --embedding-pooling, or skip the L2 normalisation.
    pooling: Literal["last", "mean"] | None = None
    normalize: bool = True

    def inputs(self) -> list[str | list[int]]:
        return as_batch(self.input, "input")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
