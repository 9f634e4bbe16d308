"""Structured output: a request's JSON schema, regex, choice or grammar turned into a per-token mask.

``params.py`` is what a request asks for (``SamplingParams.structured_outputs``, vLLM's names), checked where it is
built; ``grammar.py`` is the engine's side, on llguidance: a matcher per sequence, compiled on a thread pool, and
the bitmask of allowed tokens that the sampler applies on the device (docs/structured_output.md).
"""

from cvllm.structured_output.params import StructuredOutputsParams, reasoning_bounds

__all__ = ["StructuredOutputsParams", "reasoning_bounds"]
