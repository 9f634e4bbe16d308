"""Checkpoints: what a plugin's ``open_checkpoint`` hook returns, and the built-in HF-directory reader."""

from cvllm.checkpoint.base import Checkpoint, CheckpointError

__all__ = ["Checkpoint", "CheckpointError"]
