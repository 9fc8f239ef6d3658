"""/v1/models, /version and /health."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter: its name (vLLM puts the directory here; server paths stay private)
    parent: str | None = None  # a LoRA adapter: its base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class HealthStatus(BaseModel):
    status: str
    reason: str | None = None
