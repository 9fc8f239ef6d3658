"""vLLM's runtime LoRA endpoints: /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from tokenmill.server.protocol.base import LenientModel


class LoadLoRAAdapterRequest(LenientModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(LenientModel):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is accepted and not needed: names are unique)."""

    lora_name: str
    lora_int_id: int | None = None
