"""cvllm model plugin: Qwen2/2.5, QwQ, DeepSeek-R1-Distill-Qwen, Qwen3, Qwen2-MoE and Qwen3-MoE."""
