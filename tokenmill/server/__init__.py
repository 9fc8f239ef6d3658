"""The serving layer: OpenAI-compatible HTTP (FastAPI), gRPC, metrics, health and graceful drain."""
