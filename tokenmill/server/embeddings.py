"""OpenAI /v1/embeddings: each input is an engine request that only prefills (batched with generation
like any other) and answers with its pooled final hidden state."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass

import numpy as np

from tokenmill.engine.input_processor import PromptInput
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.generation import Generation
from tokenmill.server.openai_api import Job, _checked, final_outputs
from tokenmill.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, parse_request
from tokenmill.server.state import RequestRecord, ServerState


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a JSON array, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


@dataclass
class EmbeddingJob(Job):
    encoding_format: str = "float"

    async def full(self, gen: Generation) -> EmbeddingResponse:
        finals = await final_outputs(gen)
        data = [
            EmbeddingData(index=i, embedding=encode(finals[i].embedding, self.encoding_format)) for i in sorted(finals)
        ]
        tokens = sum(len(out.prompt_token_ids) for out in finals.values())
        return EmbeddingResponse(
            data=data, model=self.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        )


async def prepare_embedding(state: ServerState, record: RequestRecord, raw: bytes) -> EmbeddingJob:
    req: EmbeddingRequest = parse_request(EmbeddingRequest, raw)
    adapter = state.resolve_model(req.model)
    hidden_size = state.engine.hidden_size
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise bad_request(
            f"dimensions must be {hidden_size} (this model's hidden size) or unset: its embeddings "
            f"cannot be shortened to {req.dimensions}",
            param="dimensions",
            code="invalid_value",
        )
    params = PoolingParams(req.pooling or state.settings.embedding_pooling, normalize=req.normalize)
    batch = req.inputs()
    processor = state.engine.input_processor
    escape = state.settings.escape_special_tokens_in_prompts

    def process() -> list[PromptInput]:
        return [processor.process(p, params, param="input", escape_special=escape, lora=adapter) for p in batch]

    prompts = await _checked(asyncio.to_thread(process))
    if state.settings.log_prompts:
        record.prompt_text = repr(req.input)
    return EmbeddingJob(
        prompts=prompts,
        params=params,
        stream=False,
        include_usage=False,
        model=state.model_name(adapter),
        response_id=f"embd-{record.request_id}",
        encoding_format=req.encoding_format,
    )
