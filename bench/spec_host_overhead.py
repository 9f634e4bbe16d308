"""The engine's own host time a step, plain decoding against n-gram speculation (issue 22), without a model:
``EngineConfig(fake_step_ms=0)`` returns fixed logits at once, over a small vocabulary so that the sampler's work
on a real vocabulary does not count either. What is left is the scheduler, the draft lookup, the acceptance
bookkeeping and the step's Python around them: the part of a speculative step's host time that is the engine's,
not the backend's.

    python bench/spec_host_overhead.py          # any machine (CPU backend)
"""

from __future__ import annotations

import time
from pathlib import Path

from cvllm.checkpoint.base import Checkpoint
from cvllm.config import ModelConfig
from cvllm.engine.build import build_engine
from cvllm.engine.config import EngineConfig
from cvllm.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def ms_per_step(spec: dict | None, tokens: int = 600) -> tuple[float, int]:
    """Milliseconds a step and steps taken for one request of ``tokens`` at batch 1 (the second of two runs)."""
    config = ModelConfig(vocab_size=2000, max_position_embeddings=4096, architectures=["Fake"], eos_token_id=1)
    engine = build_engine(EngineConfig(model=Checkpoint(Path("fake"), config, lambda: iter(())), backend="cpu",
                                       fake_step_ms=0, num_kv_blocks=512, max_num_seqs=4, speculative_config=spec))
    prompt = engine.runner.token_cycle[:200].tolist() * 2   # text the n-gram lookup finds continuations in
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for run in range(2):
        engine.add_request(f"r{run}", prompt, params)
        steps, started = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        wall = time.perf_counter() - started
    engine.shutdown()
    return wall * 1e3 / steps, steps


def main() -> None:
    for name, spec in (("plain", None), ("ngram K=4", NGRAM)):
        ms, steps = ms_per_step(spec)
        print(f"{name:10s} {ms:.3f} ms a step over {steps} steps")


if __name__ == "__main__":
    main()
