"""The engine's core: requests and their sequences, the scheduler, and the KV block manager."""
