"""cvllm-example-plugin: a third-party model plugin for cvllm, adding the TinyGPT architecture.

Deliberately empty of imports: cvllm imports ``cvllm_example.plugin`` at every start, which runs
this file first, so it must stay cheap (no torch, no model code).
"""
