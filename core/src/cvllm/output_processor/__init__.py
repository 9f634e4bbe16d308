"""The one output path: from the engine core's ``SeqDelta`` messages to text, for the offline API and the server.

The core sends token ids (and raw logprobs) only; everything a request's outputs need after that lives here:
incremental detokenization, stop strings (which end a completion before the core knows: the front-end then
tells its core to stop it), finish reasons, n completions, the prompt's logprobs and cached tokens.

- ``CompletionState`` (completion.py): one completion: its tokens, logprobs, text, finish reason.
- ``RequestState`` (request.py): one request's n completions; streamed updates for the server.
- ``OutputProcessor`` (processor.py): many requests' deltas to vLLM's ``RequestOutput``, for ``LLM``.

The server renders its OpenAI chunks from the streamed updates (server/output.py, serving_*.py). The sampling
defaults both front-ends start from are in cvllm/sampling_defaults.py.
"""

from cvllm.output_processor.completion import CompletionState, CompletionUpdate
from cvllm.output_processor.processor import OutputProcessor, ProcessedStep, request_output
from cvllm.output_processor.request import RequestState

__all__ = ["CompletionState", "CompletionUpdate", "OutputProcessor", "ProcessedStep", "RequestState",
           "request_output"]
