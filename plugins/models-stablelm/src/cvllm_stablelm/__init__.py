"""cvllm model plugin for StableLM (kept light: cvllm imports it at every start)."""
