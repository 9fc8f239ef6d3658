"""Where a model comes from and how its weights become a tokenmill model: hub, registry, loader, generic path."""
