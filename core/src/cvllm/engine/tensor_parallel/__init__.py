"""Tensor parallelism over torch.distributed: rank 0 is the engine's process (it schedules, runs its shard and
samples), ranks 1..N-1 are worker processes that run their shards of each step's forward pass (issue 17)."""
