"""`tokenmill bench offline`: the engine in this process, no server, on a mixed-length workload.

A seeded workload goes through the offline API with all requests submitted at once
(`LLM.generate`), each with ignore_eos and its own max_tokens, so every run produces exactly the
requested number of tokens; reported: useful output tokens/s, latency and TTFT. `--model tiny`
uses a random ~28M Llama built once in the cache. Options add, in the same process:

- `--compare hf`: Hugging Face `generate` in padded static batches on the same prompts (the naive
  baseline), its padding waste, the tokenmill/HF throughput ratio and greedy agreement;
- `--compare model-impl`: the workload on the native path and on the generic transformers path
  (`--model-impl native` / `transformers`), each in a fresh process: the generic path's cost;
- `--compare structured-output`: the workload unconstrained and with every request constrained to
  a JSON schema (`STRUCTURED_SCHEMA`), each in a fresh process: the grammar masks' cost;
- `--sweep`: the workload at several concurrency limits (max_num_seqs), latency vs throughput;
- `--roofline`: copy bandwidth, weight bytes and the batch-1 decode bound vs the measured step;
- `--long-outputs`: host time per output token of long streams, cumulative vs delta outputs.
"""

from tokenmill.bench.offline.cli import add_args, main

__all__ = ["add_args", "main"]
