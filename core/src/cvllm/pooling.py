"""How a model's final hidden states become one embedding per input (``/v1/embeddings``, ``LLM.embed``).

A checkpoint declares its pooling the sentence-transformers way (checkpoint/sentence_transformers.py reads
modules.json and 1_Pooling/config.json); ``cvserve --task embed`` embeds with any decoder model, by default with
the last token's hidden state, L2-normalised (what Qwen3-Embedding and most decoder embedding models do, and
unit length as OpenAI's embeddings are). A declared configuration is followed as sentence-transformers follows
it, Normalize module or not, so the vectors are the ones ``SentenceTransformer(path).encode()`` gives.

Torch-free: the API process and the engine-core messages use it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# cvserve --task: auto = generation, plus embeddings where the checkpoint declares a pooling; generate = no
# embeddings; embed = embeddings on any checkpoint (generation keeps working: it is the same engine)
TASKS = ("auto", "generate", "embed")

PoolingMethod = Literal["last", "mean", "cls"]


class PoolingConfig(msgspec.Struct, frozen=True):
    method: PoolingMethod = "last"    # the last token's hidden state, the mean over the input's tokens, or the first's
    normalize: bool = True            # L2-normalise the pooled vector (after any Matryoshka truncation)
    source: str = "--task embed"      # where the setting came from, for logs and errors

    def describe(self) -> str:
        name = {"last": "last-token", "mean": "mean", "cls": "first-token (CLS)"}[self.method]
        return f"{name} pooling, {'L2-normalised' if self.normalize else 'not normalised'} ({self.source})"


def served_pooling(task: str, declared: PoolingConfig | None) -> PoolingConfig | None:
    """The pooling ``/v1/embeddings`` uses under ``--task``, given what the checkpoint declares (None: the endpoint
    is refused)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "generate":
        return None
    if declared is not None:
        return declared
    return PoolingConfig() if task == "embed" else None


def check_dimensions(dimensions: int | None, hidden_size: int, matryoshka: list[int] | None) -> None:
    """``dimensions`` (Matryoshka truncation) must be one the model declares in config.json's
    ``matryoshka_dimensions``; a model that declares none may be cut to any size from 1 to its hidden size (the
    caller's judgement: a model not trained for it embeds worse when cut). Raises ValueError saying why not."""
    if dimensions is None:
        return
    if matryoshka:
        if dimensions not in matryoshka:
            raise ValueError(f"dimensions must be one of the model's Matryoshka dimensions "
                             f"{sorted(matryoshka)}, got {dimensions}")
    elif not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions must be between 1 and the model's embedding size {hidden_size}, got "
                         f"{dimensions}")
