"""cvllm backend plugin for Apple silicon: the engine's device operations in torch ops that the MPS device runs.

The same code runs on CPU tensors when ``CVLLM_METAL_ON_CPU=1`` (or ``MetalBackend(device="cpu")``), which is how CI
tests it against the CPU reference backend without a Mac (docs/metal.md says what ran where).
"""
