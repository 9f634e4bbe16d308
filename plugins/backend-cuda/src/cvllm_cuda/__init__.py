"""cvllm's CUDA backend: Triton paged attention and KV-cache kernels, CUDA graphs for decode steps."""
