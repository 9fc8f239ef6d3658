"""Serving benchmarks: an open-loop load generator for OpenAI-compatible servers (`bench serve`),
a naive one-request-at-a-time Hugging Face baseline server, and `bench compare`, which drives both
with the same request trace."""
