"""Fault injectors for ``EngineConfig.fault_injector``: make chosen engine steps raise, as a failing model would,
so tests exercise the failed-step path (its requests fail, the engine core keeps serving) with a healthy model.
Module-level and picklable: a spawned engine core receives them inside its EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from cvllm.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class FailStepOnPromptToken:
    """A step that schedules a sequence whose prompt holds ``token`` raises."""
    token: int

    def __call__(self, batch: ScheduledBatch) -> None:
        if any(self.token in seq.token_ids[:seq.num_prompt_tokens] for seq in batch.seqs):
            raise RuntimeError(f"injected step failure (a prompt holds token {self.token})")
