"""cvllm model plugin: the Llama family (Llama 1/2/3/3.1/3.2, Yi, DeepSeek-R1-Distill-Llama) and Mistral."""
