"""tokenmill: high-throughput LLM inference with continuous batching over a paged KV cache."""

from tokenmill.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily so `import tokenmill` (and the CLI's --help) stays fast.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    if name == "PoolingParams":
        from tokenmill.engine.pooling_params import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from tokenmill.lora.registry import LoRARequest

        return LoRARequest
    raise AttributeError(name)
