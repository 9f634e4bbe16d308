"""Checkpoints: what a plugin's ``open_checkpoint`` hook returns, and the built-in HF-directory reader."""

from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize
from cvllm.checkpoint.nested import NestedTextModel

__all__ = ["Checkpoint", "CheckpointError", "LazyTensor", "NestedTextModel", "lazy_aware", "materialize"]
