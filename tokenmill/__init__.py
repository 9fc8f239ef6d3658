"""tokenmill: high-throughput LLM inference with continuous batching over a paged KV cache."""

import os

# OpenMP workers that spin while waiting steal the cores from the engine and HTTP threads of the
# same process (and from neighbours): measured 10x slower decode steps on a busy 2-core machine.
# Set before torch is first imported; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenmill.engine.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily so `import tokenmill` (and the CLI's --help) stays fast.
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(name)
