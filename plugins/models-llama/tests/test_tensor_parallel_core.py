"""Tensor parallelism behind cvserve's engine process (EngineCoreClient), and a worker that dies before the
process group forms: rank 0 fails at once with the worker's exit code instead of waiting for gloo's timeout."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path

import pytest

from cvllm import SamplingParams
from cvllm.engine.config import EngineConfig
from cvllm.engine_process.client import EngineCoreClient
from cvllm.testing.checkpoints import make_checkpoint

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc: no psutil needed)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def serve(model_dir: Path, tensor_parallel_size: int) -> tuple[list[list[int]], set[int], int | None]:
    config = EngineConfig(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=32,
                          max_num_seqs=8, tensor_parallel_size=tensor_parallel_size)
    client = await EngineCoreClient.start(config, startup_timeout=120)
    try:
        workers = children(client.pid)
        streams = [client.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        tokens = []
        for stream in streams:
            ids = []
            async for deltas in stream:
                for delta in deltas:
                    ids += delta.token_ids
            tokens.append(ids)
    finally:
        await client.shutdown(timeout=30)
    return tokens, workers, client.exit_code


def test_engine_process_two_ranks_match_one(tmp_path):
    make_checkpoint(tmp_path)
    tokens, workers, exit_code = asyncio.run(serve(tmp_path, 2))
    reference, _, _ = asyncio.run(serve(tmp_path, 1))
    assert tokens == reference and all(len(t) == GREEDY.max_tokens for t in tokens)
    assert len(workers) == 1, "one worker process (rank 1) under the core process"
    assert exit_code == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers), "a tensor-parallel worker outlived the engine core"


class ExitAtOnce:
    """Unpickled in the worker as ``os._exit(3)``: the worker dies before joining the process group."""

    def __reduce__(self):
        return os._exit, (3,)


def test_worker_dead_before_the_group_forms(tmp_path):
    from cvllm.engine.tensor_parallel import executor
    from cvllm.engine.tensor_parallel.worker import WorkerSpec

    spec = WorkerSpec(checkpoint=ExitAtOnce(), model_class="x:Y", backend_class="x:Y", quantizer=None,
                      dtype=None, isq=None, block_size=16, world_size=2, ranks_per_node=2, device_ids=(0, 1),
                      dist_backend="gloo", init_method="", timeout_s=600.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 \(pid \d+\) exited with code 3 before"):
        executor.TensorParallelGroup(dataclasses.replace(spec))
    assert time.monotonic() - start < 60
    import torch.distributed as dist

    from cvllm.distributed import tp_size

    assert tp_size() == 1 and not dist.is_initialized()
