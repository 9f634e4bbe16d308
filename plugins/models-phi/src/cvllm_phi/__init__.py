"""cvllm model plugin: Phi-2 (PhiForCausalLM) and Phi-3 / 3.5 / Phi-4-mini (Phi3ForCausalLM)."""
