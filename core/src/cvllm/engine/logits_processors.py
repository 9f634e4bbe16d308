"""Named logits processors: transforms of the logits that plugins register (``register_samplers``) and requests
ask for by name (``SamplingParams.logits_processors``, the HTTP API's ``logits_processors`` field), as the grammar
masks of structured output will.

The sampler applies them to the rows of the requests that named them, in the order each request named them,
after taking the raw logprobs it returns (the model's own) and before logit_bias, min_tokens, penalties and
temperature. A batch in which no request names one costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cvllm import plugins
from cvllm.engine.upload import upload

if TYPE_CHECKING:
    from cvllm.engine.sampler import SamplerRow


class LogitsProcessor:
    """Subclass it and register ``"module:Class"`` through the ``register_samplers`` hook. The engine makes one
    instance per name, when a request first names it: ``Class(vocab_size=V, device=d)`` (V: the logits' width)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """The logits ``[b, V]`` (float32, on ``device``) of the b ``rows`` whose requests named this processor, in
        the batch's order, transformed (in place or into a new tensor, returned). Called once a step per position
        in the requests' lists. It runs on the engine's decode path: read nothing back to the host (``.item()``,
        ``.tolist()``, ``.cpu()`` wait for the device). Under async scheduling (the CUDA default) a row's
        ``token_ids`` may lack the tokens of the step still in flight."""
        raise NotImplementedError


class LogitsProcessors:
    """The processors the requests have named so far, one instance per name, made from the plugins' registrations
    on first use."""

    def __init__(self) -> None:
        self._instances: dict[str, LogitsProcessor] = {}

    def get(self, name: str, vocab_size: int, device: torch.device) -> LogitsProcessor:
        processor = self._instances.get(name)
        if processor is None:
            processor_class = plugins.logits_processors().get(name)
            processor = self._instances[name] = processor_class(vocab_size=vocab_size, device=device)
        return processor

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Each row's processors applied to it, in its request's order; rows that named none are left as they are.
        At list position k, the rows whose k-th name is the same go to that processor in one call."""
        names = [row.sampling_params.logits_processors or () for row in rows]
        for position in range(max(map(len, names))):
            groups: dict[str, list[int]] = {}
            for i, row_names in enumerate(names):
                if position < len(row_names):
                    groups.setdefault(row_names[position], []).append(i)
            for name, indices in groups.items():
                processor = self.get(name, logits.shape[1], logits.device)
                if len(indices) == len(rows):
                    logits = processor.apply(logits, rows)
                    continue
                index = upload(torch.tensor(indices), logits.device)   # no wait for the device (upload.py)
                processed = processor.apply(logits.index_select(0, index), [rows[i] for i in indices])
                logits = logits.index_copy(0, index, processed)
        return logits
