"""Layers shared by the model families: paged attention, linear backends, the vocabulary head, MoE, TP."""
