"""cvllm: an LLM inference and serving engine with a paged KV cache, continuous batching and plugins."""

from cvllm.outputs import CompletionOutput, Logprob, RequestOutput
from cvllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in the engine and torch; importing cvllm for plugins or the CLI shouldn't.
    if name == "LLM":
        from cvllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'cvllm' has no attribute {name!r}")
