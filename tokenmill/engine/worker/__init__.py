"""Running a scheduled step: input tensors, the model over the paged KV cache, CUDA graphs, tensor parallelism."""
