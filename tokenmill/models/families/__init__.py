"""Native model families: each module registers the architectures it serves (see model_loader/registry.py)."""
