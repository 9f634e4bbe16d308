"""cvllm's FP8 weight plugin: FP8 (e4m3) checkpoints and in-situ FP8 quantization."""
