"""The engine: scheduler, paged KV cache, model runner, sampler, detokenizer."""
