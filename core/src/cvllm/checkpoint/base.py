"""The Checkpoint record every reader (HF directory, GGUF, ...) produces."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cvllm.checkpoint.lazy import LazyTensor, materialize
from cvllm.config import ModelConfig
from cvllm.pooling import PoolingConfig


class CheckpointError(ValueError):
    """A weight or config file is malformed; the message names the file and what is wrong. ``tensor``: the checkpoint
    tensor it is about, where a loader knows no file (build_model then names the file: Checkpoint.file_of)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    # Yields (hugging-face parameter name, tensor) pairs; a callable so opening is cheap and
    # weights are read once, while loading. A tensor may be a LazyTensor (checkpoint/lazy.py), read only
    # as far as a tensor-parallel rank needs it; read the pairs through ``weights()``.
    weight_iterator: Callable[[], Iterator[tuple[str, torch.Tensor | LazyTensor]]]
    tokenizer: Any = None  # cvllm.tokenizer.Tokenizer, or None when the checkpoint has none
    generation_config: dict[str, Any] = field(default_factory=dict)
    quant_method: str | None = None  # the quantizer registered under this name attaches the linear methods
    format: str = "hf"
    # what that quantizer needs to know about the file (quantization_config, per-tensor GGML types ...)
    quant_config: Any = None
    # the embedding pooling the checkpoint declares (sentence-transformers' modules.json), else None (pooling.py)
    pooling: PoolingConfig | None = None
    # the file a tensor of that name is in, None where unknown (hf_dir.py); errors name it (file_of)
    tensor_file: Callable[[str], Path | None] | None = None

    def weights(self, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
        """The (name, tensor) pairs, each tensor read whole; ``lazy``: LazyTensors left unread, for loaders that
        narrow them first (tensor-parallel ranks)."""
        weights = self.weight_iterator()
        return weights if lazy else ((name, materialize(tensor)) for name, tensor in weights)

    def file_of(self, tensor: str | None) -> Path:
        """The file that holds checkpoint tensor ``tensor`` where the reader can tell (``tensor_file``), else the
        checkpoint's path (a GGUF file, a directory)."""
        found = self.tensor_file(tensor) if tensor is not None and self.tensor_file is not None else None
        return found or self.path

    @property
    def architecture(self) -> str:
        return self.config.architectures[0]

    def eos_token_ids(self) -> set[int]:
        """The stop set (docs/architecture.md, "When generation stops"): eos ids from config.json and
        generation_config.json."""
        ids: set[int] = set()
        for source in (self.config.get("eos_token_id"), self.generation_config.get("eos_token_id")):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids
