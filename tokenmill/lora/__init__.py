"""Multi-LoRA serving: PEFT adapters selected per request, batched together with the base model."""

from tokenmill.lora.registry import LoRARequest

__all__ = ["LoRARequest"]
