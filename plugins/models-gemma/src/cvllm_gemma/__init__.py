"""cvllm's Gemma family plugin (Gemma, Gemma 2, Gemma 3). Kept empty: cvllm imports it at every start."""
