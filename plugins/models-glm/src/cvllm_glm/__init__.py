"""cvllm model plugin for GLM-4 and GLM-4-0414 (kept light: cvllm imports it at every start)."""
