"""Structured outputs: what a request's output must match, compiled to grammars that mask each step's logits."""
