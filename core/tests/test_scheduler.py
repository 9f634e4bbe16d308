"""Scheduler + BlockManager: budget, chunked prefill, admission, preemption, freeing (pure Python, no torch)."""

import os
import random
import subprocess
import sys
from itertools import count
from pathlib import Path
from types import SimpleNamespace

import pytest

from cvllm.engine.block_manager import BlockManager
from cvllm.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from cvllm.engine.sequence import Sequence, SequenceStatus

_ids = count(1000)  # distinct token ids, so prompts never share a prefix unless a test says so


def make_seq(seq_id: int, prompt=None, length: int = 0) -> Sequence:
    tokens = list(prompt) if prompt is not None else [next(_ids) for _ in range(length)]
    return Sequence(seq_id, f"req-{seq_id}", tokens, SimpleNamespace())


def make_scheduler(num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size, prefix_caching))


def step(sched: Scheduler, token: int = 7) -> ScheduledBatch:
    """One engine step without a model: schedule, advance, append a token where the engine would sample."""
    batch = sched.schedule()
    sampled = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
    sched.advance(batch)
    for seq in sampled:
        seq.append_token(token)
    return batch


def scheduled(batch: ScheduledBatch) -> list[tuple[int, int]]:
    return [(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_tokens)]


def test_importing_the_scheduler_does_not_import_torch():
    src = Path(__file__).resolve().parents[1] / "src"
    code = "import cvllm.engine.scheduler, sys; assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(src)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_token_budget_chunks_and_mixed_steps():
    sched = make_scheduler(max_num_batched_tokens=8)
    s0, s1, s2 = make_seq(0, length=5), make_seq(1, length=5), make_seq(2, length=5)
    for seq in (s0, s1, s2):
        sched.add(seq)

    batch = step(sched)
    assert scheduled(batch) == [(0, 5), (1, 3)]      # s1 gets what is left of the budget
    assert batch.num_prefill_tokens == 8 and batch.num_decodes == 0
    assert [s.seq_id for s in sched.waiting] == [2]
    assert sched.stats.prefill_chunks == 1 and sched.stats.mixed_steps == 0

    batch = step(sched)
    assert scheduled(batch) == [(0, 1), (1, 2), (2, 5)]  # decode first, then s1's last chunk, then s2
    assert batch.num_decodes == 1 and batch.num_prefill_tokens == 7
    assert sched.stats.mixed_steps == 1 and sched.stats.prefill_chunks == 1

    batch = step(sched)
    assert scheduled(batch) == [(0, 1), (1, 1), (2, 1)]
    assert batch.num_decodes == 3 and batch.num_prefill_tokens == 0
    assert sched.stats.steps == 3 and sched.stats.mixed_steps == 1
    assert sched.stats.prompt_tokens_computed == 15
    assert [s.num_tokens for s in (s0, s1, s2)] == [8, 7, 7]


def test_decodes_go_before_waiting_prompts():
    sched = make_scheduler(max_num_batched_tokens=3)
    for i in range(3):
        sched.add(make_seq(i, length=1))
    assert scheduled(step(sched)) == [(0, 1), (1, 1), (2, 1)]
    late = make_seq(3, length=3)
    sched.add(late)
    # The three decodes use the whole budget: the new prompt waits.
    assert scheduled(step(sched)) == [(0, 1), (1, 1), (2, 1)]
    assert list(sched.waiting) == [late] and late.block_table.tolist() == []
    sched.finish(sched.running[0], "stop")
    assert scheduled(step(sched)) == [(1, 1), (2, 1), (3, 1)]


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(0, length=10)
    sched.add(seq)
    computed, sampled = [], []
    for _ in range(4):
        batch = sched.schedule()
        sampled.append(batch.samples(0))
        sched.advance(batch)
        computed.append(seq.num_computed_tokens)
        if sampled[-1]:
            seq.append_token(5)
        assert len(seq.block_table) == -(-seq.num_computed_tokens // 4)
    assert computed == [4, 8, 10, 11]
    assert sampled == [False, False, True, True]      # logits only once the prompt is complete
    assert sched.stats.prefill_chunks == 2
    assert sched.stats.prompt_tokens_computed == 10


def test_prefill_chunk_size_caps_one_prompt():
    sched = make_scheduler(max_num_batched_tokens=100, prefill_chunk_size=3)
    sched.add(make_seq(0, length=5))
    sched.add(make_seq(1, length=5))
    assert scheduled(step(sched)) == [(0, 3), (1, 3)]
    assert sched.stats.prefill_chunks == 2
    assert scheduled(step(sched)) == [(0, 2), (1, 2)]
    assert sched.stats.prefill_chunks == 2
    assert scheduled(step(sched)) == [(0, 1), (1, 1)]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i, length=2))
    assert scheduled(step(sched)) == [(0, 2), (1, 2)]
    assert [s.seq_id for s in sched.waiting] == [2]
    assert scheduled(step(sched)) == [(0, 1), (1, 1)]
    sched.finish(sched.running[0], "length")
    assert scheduled(step(sched)) == [(1, 1), (2, 2)]


def test_add_rejects_prompts_longer_than_max_model_len():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        sched.add(make_seq(0, length=9))
    assert not sched.has_unfinished()
    sched.add(make_seq(1, length=8))
    assert sched.has_unfinished()


def test_admission_stops_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4)
    seqs = [make_seq(i, length=8) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert scheduled(step(sched)) == [(0, 8), (1, 8)]
    assert [s.block_table.tolist() for s in seqs] == [[0, 1], [2, 3], []]
    assert seqs[2].num_computed_tokens == 0 and seqs[2].status is SequenceStatus.WAITING
    assert sched.block_manager.num_free_blocks == 0


def test_failed_admission_gives_back_its_prefix_hit():
    sched = make_scheduler(num_blocks=5)
    bm = sched.block_manager
    s0 = make_seq(0, range(1, 10))                 # 9 tokens: blocks 0, 1 cached, 2 partial
    sched.add(s0)
    step(sched)
    s1 = make_seq(1, [*range(1, 9), *range(50, 62)])  # hits 8 tokens, then needs 3 blocks; 2 are free
    sched.add(s1)
    assert scheduled(step(sched)) == [(0, 1)]
    assert list(sched.waiting) == [s1]
    assert s1.block_table.tolist() == [] and s1.num_computed_tokens == 0
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0, 0]
    assert sched.stats.prefix_hit_tokens == 0
    sched.finish(s0, "stop")
    assert scheduled(step(sched)) == [(1, 12)]         # admitted now, with its hit
    assert sched.stats.prefix_hit_tokens == 8


def test_prefix_hit_tokens_counted_on_admission():
    sched = make_scheduler()
    bm = sched.block_manager
    s0 = make_seq(0, range(1, 10))
    sched.add(s0)
    step(sched)
    s1 = make_seq(1, [*range(1, 9), 50, 51])
    sched.add(s1)
    assert scheduled(step(sched)) == [(0, 1), (1, 2)]
    assert sched.stats.prefix_hit_tokens == 8
    assert s1.block_table[:2].tolist() == s0.block_table[:2].tolist() == [0, 1]
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    assert sched.stats.prompt_tokens_computed == 9 + 2


def test_num_cached_tokens_is_the_first_admissions_hit():
    sched = make_scheduler()
    s0 = make_seq(0, range(1, 10))
    sched.add(s0)
    step(sched)
    s1 = make_seq(1, [*range(1, 9), *range(50, 58)])   # shares s0's first two blocks
    sched.add(s1)
    step(sched)
    assert (s0.num_cached_tokens, s1.num_cached_tokens) == (0, 8)
    sched._preempt(s1)
    step(sched)   # readmitted: it hits its own 4 blocks now, a recomputation saved, not a client's prefix hit
    assert sched.stats.prefix_hit_tokens == 8 + 16
    assert s1.num_cached_tokens == 8


def test_preemption_newest_first_to_the_front_of_waiting_then_resumed():
    sched = make_scheduler(num_blocks=6)
    bm = sched.block_manager
    s0, s1, s2, s3 = (make_seq(i, length=8) for i in range(4))
    for seq in (s0, s1, s2, s3):
        sched.add(seq)
    assert scheduled(step(sched)) == [(0, 8), (1, 8), (2, 8)]
    assert list(sched.waiting) == [s3]

    # Every decode now needs a third block and none is free: s2, the newest, is preempted.
    batch = step(sched)
    assert scheduled(batch) == [(0, 1), (1, 1)]
    assert sched.stats.preemptions == 1
    assert list(sched.waiting) == [s2, s3]        # at the front, ahead of older waiting work
    assert s2.status is SequenceStatus.WAITING
    assert s2.num_computed_tokens == 0 and s2.block_table.tolist() == [] and s2.num_hashed_blocks == 0
    assert s0.block_table.tolist() == [0, 1, 5] and s1.block_table.tolist() == [2, 3, 4]  # s2's blocks, tail first
    assert s2.num_tokens == 9                     # its generated token is kept and recomputed

    sched.finish(s0, "stop")
    sched.finish(s1, "stop")
    batch = step(sched)
    assert scheduled(batch) == [(2, 9), (3, 8)]   # recompute: s2's cached blocks were evicted
    assert s2.num_tokens == 10 and s2.num_computed_tokens == 9
    assert sched.stats.preemptions == 1
    assert bm.num_free_blocks == 6 - 3 - 2


def test_two_preemptions_and_self_preemption():
    sched = make_scheduler(num_blocks=4)
    s0, s1, s2 = make_seq(0, length=8), make_seq(1, length=4), make_seq(2, length=4)
    for seq in (s0, s1, s2):
        sched.add(seq)
    assert scheduled(step(sched)) == [(0, 8), (1, 4), (2, 4)]
    # s0 takes s2's block; s1 then finds nothing and, being the newest left, preempts itself.
    assert scheduled(step(sched)) == [(0, 1)]
    assert sched.stats.preemptions == 2
    assert sched.running == [s0] and list(sched.waiting) == [s1, s2]
    assert s0.block_table.tolist() == [0, 1, 3]
    assert sched.block_manager.num_free_blocks == 1


def test_lone_sequence_that_cannot_grow_preempts_itself():
    sched = make_scheduler(num_blocks=2)
    bm = sched.block_manager
    seq = make_seq(0, length=8)
    sched.add(seq)
    assert scheduled(step(sched)) == [(0, 8)]
    assert seq.num_tokens == 9
    batch = step(sched)                           # the decode needs a third block: there is none
    assert len(batch) == 0
    assert sched.stats.preemptions == 1 and sched.stats.steps == 1
    assert sched.running == [] and list(sched.waiting) == [seq]
    assert bm.num_free_blocks == 2 and [b.ref_count for b in bm.blocks] == [0, 0]
    # Readmission hits both cached blocks, still can't grow, and gives them back.
    assert len(step(sched)) == 0
    assert seq.block_table.tolist() == [] and bm.num_free_blocks == 2
    assert sched.stats.prefix_hit_tokens == 0


def test_finish_frees_running_and_waiting_sequences():
    sched = make_scheduler(num_blocks=4)
    bm = sched.block_manager
    running, waiting = make_seq(0, length=10), make_seq(1, length=10)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert sched.running == [running] and list(sched.waiting) == [waiting]
    sched.finish(running, "abort")
    assert running.status is SequenceStatus.FINISHED and running.finish_reason == "abort"
    assert running.block_table.tolist() == [] and bm.num_free_blocks == 4
    assert sched.running == []
    sched.finish(waiting, "abort")
    assert list(sched.waiting) == [] and waiting.is_finished
    assert not sched.has_unfinished()
    assert len(sched.schedule()) == 0


def test_engine_loop_to_completion_frees_every_block():
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=6)
    bm = sched.block_manager
    shared = list(range(1, 9))
    seqs = [make_seq(i, [*shared, *range(100 * i, 100 * i + 3 + i)]) for i in range(4)]
    targets = {0: 3, 1: 5, 2: 1, 3: 4}            # generated tokens each sequence stops at
    for seq in seqs:
        sched.add(seq)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
        for seq in list(sched.running):
            if seq.num_output_tokens >= targets[seq.seq_id]:
                sched.finish(seq, "length")
    assert not sched.has_unfinished()
    assert [s.num_output_tokens for s in seqs] == [3, 5, 1, 4]
    assert sched.stats.prefix_hit_tokens > 0 and sched.stats.prefill_chunks > 0
    assert bm.num_free_blocks == 12
    assert all(b.ref_count == 0 for b in bm.blocks)


# -- randomized simulation -----------------------------------------------------------------------


class FakeKVCache:
    """Records, per slot, a fingerprint of the whole prefix whose K/V it holds (K/V depend on all of it)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.fingerprints: dict[int, list[int]] = {}

    def _fingerprint(self, seq: Sequence, position: int) -> int:
        fps = self.fingerprints.setdefault(seq.seq_id, [])
        while len(fps) <= position:
            fps.append(hash((fps[-1] if fps else None, seq.token_ids[len(fps)])))
        return fps[position]

    def forward(self, bm: BlockManager, seq: Sequence, n: int) -> None:
        bs, table = self.block_size, seq.block_table
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            assert bm.blocks[table[p // bs]].ref_count == 1, "wrote into a shared block"
            self.slots[table[p // bs], p % bs] = self._fingerprint(seq, p)
        for p in range(seq.num_computed_tokens + n):   # attention reads the whole prefix
            assert self.slots.get((table[p // bs], p % bs)) == self._fingerprint(seq, p), (seq, p)


def check_invariants(sched: Scheduler, live: set[Sequence]) -> None:
    bm = sched.block_manager
    assert set(sched.running) | set(sched.waiting) == live
    assert len(sched.running) + len(sched.waiting) == len(live)
    refs = [0] * bm.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            refs[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert sum(b.ref_count for b in bm.blocks) == sum(len(s.block_table) for s in live)
    free, referenced = set(bm.free_blocks), {i for i, r in enumerate(refs) if r}
    assert not free & referenced and free | referenced == set(range(bm.num_blocks))
    for seq in sched.running:
        assert len(seq.block_table) >= -(-seq.num_computed_tokens // bm.block_size)
        assert seq.status is SequenceStatus.RUNNING
    for seq in sched.waiting:
        assert seq.block_table.tolist() == [] and seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block.items())


@pytest.mark.parametrize("seed, chunk_size, prefix_caching", [(0, 0, True), (1, 5, True), (2, 0, False)])
def test_randomized_simulation_keeps_invariants(seed, chunk_size, prefix_caching):
    rng = random.Random(seed)
    config = dict(max_num_seqs=6, max_num_batched_tokens=16, max_model_len=48, prefill_chunk_size=chunk_size)
    sched = make_scheduler(num_blocks=20, block_size=4, prefix_caching=prefix_caching, **config)
    bm, kv = sched.block_manager, FakeKVCache(4)
    # Block-aligned words: prompts share prefixes, and the same block content follows different prefixes.
    words = [[rng.randrange(1000) for _ in range(4)] for _ in range(4)]
    live: set[Sequence] = set()
    targets: dict[int, int] = {}
    added = finished = 0
    for _ in range(5000):
        if added < 150 and rng.random() < 0.5:
            prefix = [t for _ in range(rng.randint(0, 3)) for t in rng.choice(words)]
            tail = [rng.randrange(1000) for _ in range(rng.randint(0 if prefix else 1, 16))]
            seq = make_seq(added, prefix + tail)   # words only, sometimes: a whole prompt can be cached
            sched.add(seq)
            live.add(seq)
            targets[seq.seq_id] = rng.randint(1, 12)
            added += 1
        if live and rng.random() < 0.05:   # a client goes away
            seq = rng.choice(sorted(live, key=lambda s: s.seq_id))
            sched.finish(seq, "abort")
            live.discard(seq)
            finished += 1

        batch = sched.schedule()
        assert sum(batch.num_tokens) <= config["max_num_batched_tokens"]
        assert len(batch) <= config["max_num_seqs"] and len({s.seq_id for s in batch.seqs}) == len(batch)
        assert all(n >= 1 and (not chunk_size or n <= chunk_size) for n in batch.num_tokens)
        assert all(seq in sched.running for seq in batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            assert len(seq.block_table) >= -(-(seq.num_computed_tokens + n) // bm.block_size)
            kv.forward(bm, seq, n)
        sampled = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        sched.advance(batch)
        for seq in sampled:
            seq.append_token(rng.randrange(1000))
            if seq.num_output_tokens >= targets[seq.seq_id] or seq.num_tokens >= config["max_model_len"]:
                sched.finish(seq, "length")
                live.discard(seq)
                finished += 1
        check_invariants(sched, live)
        if added == 150 and not sched.has_unfinished():
            break

    assert added == finished == 150 and not live
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    stats = sched.stats
    assert stats.preemptions > 0 and stats.mixed_steps > 0 and stats.prefill_chunks > 0
    assert (stats.prefix_hit_tokens > 0) == prefix_caching
