"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless the server was started with --enable-lora-runtime-updates (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): anyone who can reach the API could otherwise make the
server read files from its disk. Answers are plain text on success, as vLLM's; an adapter that
cannot be served is a 400 naming the problem, an unknown name to unload a 404. A path that holds no
readable adapter gets one answer whatever the reason (missing, not a directory, unreadable), so the
API reveals nothing about which paths exist on the server.
"""

from __future__ import annotations

import asyncio
import logging

from tokenmill.errors import InvalidRequest
from tokenmill.lora.registry import LoRANotFound, LoRAPathError
from tokenmill.server.errors import APIError, from_invalid_request
from tokenmill.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, parse_request
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)


def _registry(state: ServerState):
    if not state.settings.enable_lora_runtime_updates:
        raise APIError(
            403,
            "Loading and unloading LoRA adapters at run time is off: start the server with "
            "--enable-lora-runtime-updates (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).",
            code="lora_runtime_updates_disabled",
        )
    if state.engine.loras is None:
        raise APIError(400, "This server serves no LoRA adapters: start it with --enable-lora.", code="lora_disabled")
    return state.engine.loras


async def load_adapter(state: ServerState, raw: bytes) -> str:
    registry = _registry(state)
    req: LoadLoRAAdapterRequest = parse_request(LoadLoRAAdapterRequest, raw)
    try:  # reads and checks the files: off the event loop
        await asyncio.to_thread(registry.load, req.lora_name, req.lora_path)
    except LoRAPathError as exc:  # the same answer whether the path exists or not; the reason goes to the log
        logger.warning("LoRA adapter not loaded: %s", exc.message)
        raise APIError(
            400,
            f"lora_path {req.lora_path!r} is not a PEFT adapter directory this server can read",
            param="lora_path",
            code=exc.code,
        ) from None
    except InvalidRequest as exc:
        raise from_invalid_request(exc) from None
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."


async def unload_adapter(state: ServerState, raw: bytes) -> str:
    registry = _registry(state)
    req: UnloadLoRAAdapterRequest = parse_request(UnloadLoRAAdapterRequest, raw)
    try:
        registry.unload(req.lora_name)
    except LoRANotFound as exc:
        raise APIError(404, exc.message, param=exc.param, code=exc.code) from None
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
