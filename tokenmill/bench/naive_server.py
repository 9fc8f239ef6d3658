"""A deliberately naive baseline server: Hugging Face `model.generate`, one request at a time.

It speaks the same OpenAI subset as `tokenmill serve` (`POST /v1/completions`, streaming or not,
`GET /v1/models`, `GET /health/live`, `GET /health/ready`) so `tokenmill bench compare` can drive
both with the same trace. No batching, no paged KV cache: requests queue on a lock.

    python -m tokenmill.bench.naive_server --model DIR --host 127.0.0.1 --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class GenerationJob:
    """One `model.generate` call in a worker thread; `cancel` stops it early (client went away)."""

    kwargs: dict[str, Any]
    prompt_tokens: int
    cancel: threading.Event = field(default_factory=threading.Event)
    completion_ids: list[int] = field(default_factory=list)
    error: BaseException | None = None


class NaiveEngine:
    """Owns the model and tokenizer; `lock` serialises generation (that is the point of the baseline)."""

    def __init__(self, model_dir: str | Path, model_name: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        self.lock = asyncio.Lock()

    def make_job(self, body: dict[str, Any]) -> GenerationJob:
        """Translate OpenAI request fields into `generate` kwargs (validated: bad input raises ValueError)."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        prompt = body.get("prompt", "")
        if isinstance(prompt, list):  # OpenAI allows a list; the baseline handles exactly one prompt
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise ValueError("prompt must be a string or a list with one string")
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string")
        max_tokens = 16 if body.get("max_tokens") is None else int(body["max_tokens"])  # OpenAI's default
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        temperature = float(body.get("temperature", 1.0))
        encoded = self.tokenizer(prompt, return_tensors="pt")
        kwargs: dict[str, Any] = {
            **encoded,
            "max_new_tokens": max_tokens,
            "do_sample": temperature > 0,
            "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
        }
        if temperature > 0:
            kwargs.update(
                temperature=temperature,
                top_p=float(body.get("top_p", 1.0)),
                top_k=int(body.get("top_k", 0)),
                min_p=float(body["min_p"]) if body.get("min_p") else None,
            )
            if body.get("seed") is not None:
                torch.manual_seed(int(body["seed"]))
        else:
            # Greedy: clear sampling knobs the model's generation_config may carry, avoiding warnings.
            kwargs.update(temperature=None, top_p=None, top_k=None, min_p=None)
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens  # EOS is suppressed until max_tokens, like vLLM
        job = GenerationJob(kwargs=kwargs, prompt_tokens=int(encoded["input_ids"].shape[1]))

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **_: Any) -> Any:
                return torch.full((input_ids.shape[0],), job.cancel.is_set(), dtype=torch.bool)

        kwargs["stopping_criteria"] = StoppingCriteriaList([_Cancelled()])
        return job

    def run(self, job: GenerationJob) -> None:
        """Blocking: runs in a worker thread; results and errors land on the job."""
        import torch

        try:
            with torch.inference_mode():
                out = self.model.generate(**job.kwargs)
            job.completion_ids = out[0, job.prompt_tokens :].tolist()
        except BaseException as exc:
            job.error = exc
            streamer = job.kwargs.get("streamer")
            if streamer is not None:
                streamer.end()  # unblock the consumer

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # (one sequence's ids; a batch of them would decode to a list)
        return text

    def finish_reason(self, job: GenerationJob) -> str:
        return "length" if len(job.completion_ids) >= job.kwargs["max_new_tokens"] else "stop"

    def usage(self, job: GenerationJob) -> dict[str, int]:
        n = len(job.completion_ids)
        return {"prompt_tokens": job.prompt_tokens, "completion_tokens": n, "total_tokens": job.prompt_tokens + n}


def _token_streamer(tokenizer: Any) -> Any:
    """A TextIteratorStreamer that emits every token's text as soon as it decodes cleanly.

    The stock one holds text back until a word boundary, which would make the baseline's ITL mean
    "per word" while tokenmill's means "per token".
    """
    from transformers import TextIteratorStreamer

    class TokenIteratorStreamer(TextIteratorStreamer):
        def put(self, value: Any) -> None:
            if len(value.shape) > 1:
                value = value[0]
            if self.skip_prompt and self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                return
            self.token_cache.extend(value.tolist())
            text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
            assert isinstance(text, str)  # (one sequence's ids)
            if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
                return
            self.on_finalized_text(text[self.print_len :])
            self.print_len = len(text)

    return TokenIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _completion_body(engine: NaiveEngine, request_id: str, created: int, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": engine.model_name,
        "choices": [choice] if choice else [],
    }


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _generate_full(engine: NaiveEngine, job: GenerationJob, request_id: str) -> dict[str, Any]:
    async with engine.lock:
        await asyncio.to_thread(engine.run, job)
    if job.error is not None:
        raise job.error
    choice = {
        "index": 0,
        "text": engine.decode(job.completion_ids),
        "logprobs": None,
        "finish_reason": engine.finish_reason(job),
    }
    body = _completion_body(engine, request_id, int(time.time()), choice)
    body["usage"] = engine.usage(job)
    return body


async def _generate_stream(
    engine: NaiveEngine, job: GenerationJob, request_id: str, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())
    async with engine.lock:
        # No streamer timeout: the consumer blocks in a worker thread, not on the event loop.
        streamer = _token_streamer(engine.tokenizer)
        job.kwargs["streamer"] = streamer
        worker = threading.Thread(target=engine.run, args=(job,), daemon=True)
        worker.start()
        try:
            pieces = iter(streamer)
            while (text := await asyncio.to_thread(next, pieces, None)) is not None:
                if text:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
                    yield _sse(_completion_body(engine, request_id, created, choice))
        finally:
            # Client gone or done: stop generation and hold the lock until the thread is really idle.
            job.cancel.set()
            await asyncio.to_thread(worker.join)
    if job.error is not None:
        yield _sse({"error": {"message": str(job.error), "type": type(job.error).__name__}})
        yield _sse("[DONE]")
        return
    final = {"index": 0, "text": "", "logprobs": None, "finish_reason": engine.finish_reason(job)}
    yield _sse(_completion_body(engine, request_id, created, final))
    if include_usage:  # OpenAI's shape: a last chunk with no choices and the usage
        usage_chunk = _completion_body(engine, request_id, created, {})
        usage_chunk["usage"] = engine.usage(job)
        yield _sse(usage_chunk)
    yield _sse("[DONE]")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def create_app(engine: NaiveEngine) -> FastAPI:
    app = FastAPI(title="tokenmill naive baseline")

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}  # the model is loaded before the app starts

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "tokenmill-naive"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
            if int(body.get("n") or 1) != 1:
                raise ValueError("only n=1 is supported")
            job = engine.make_job(body)
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _generate_stream(engine, job, request_id, include_usage), media_type="text/event-stream"
            )
        try:
            return JSONResponse(await _generate_full(engine, job, request_id))
        except Exception as exc:
            return JSONResponse({"error": {"message": str(exc), "type": type(exc).__name__}}, status_code=500)

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.bench.naive_server",
        description="Naive Hugging Face baseline server (one request at a time) for tokenmill bench compare.",
    )
    parser.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: the bundled SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id reported by /v1/models (default: the model directory's name)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8001, help="port to bind (default: 8001)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default: warning)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from tokenmill.models.model_loader.hub import resolve_model

    args = parse_args(argv)
    engine = NaiveEngine(resolve_model(args.model), model_name=args.served_model_name)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
