"""cvllm's DeepSeek-V2/V3 models (a plugin package: its entry point registers the architectures)."""
