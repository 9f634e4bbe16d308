"""BlockManager: allocation, reference counts, prefix caching and LRU reuse (pure Python, no torch)."""

from types import SimpleNamespace

import pytest

from cvllm.engine.block_manager import BlockManager
from cvllm.engine.sequence import Sequence


def make_seq(seq_id: int, prompt) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", list(prompt), SimpleNamespace())


def compute(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler + model runner do for a whole prompt: blocks, forward pass, register full blocks."""
    assert bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


# -- allocation and freeing ------------------------------------------------------------------


def test_blocks_needed_rounds_up():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_grow_takes_free_blocks_in_order_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, range(10))
    assert bm.num_blocks == 8 and bm.num_free_blocks == 8
    assert bm.grow(a, 10)
    assert a.block_table.tolist() == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    # Already covered: no new block. One more token past the boundary: exactly one more.
    assert bm.grow(a, 12) and a.block_table.tolist() == [0, 1, 2]
    assert bm.grow(a, 13) and a.block_table.tolist() == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4


def test_grow_is_all_or_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(0, range(10)), make_seq(1, range(20))
    assert bm.grow(a, 10)
    assert not bm.can_grow(b, 24)
    assert not bm.grow(b, 24)          # needs 6 blocks, 5 free: takes none of them
    assert b.block_table.tolist() == [] and bm.num_free_blocks == 5
    assert bm.can_grow(b, 20)
    assert bm.grow(b, 20)
    assert b.block_table.tolist() == [3, 4, 5, 6, 7] and bm.num_free_blocks == 0
    assert not bm.grow(a, 13)          # a full pool refuses even one block
    assert a.block_table.tolist() == [0, 1, 2]


def test_free_returns_blocks_and_resets_sequence():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, range(10))
    assert bm.grow(a, 10)
    bm.free(a)
    assert a.block_table.tolist() == [] and a.num_hashed_blocks == 0
    assert bm.num_free_blocks == 8
    assert ref_counts(bm) == [0] * 8
    # Blocks holding no hash go to the front, head first: the next grow gets the same blocks back.
    assert list(bm.free_blocks)[:3] == [0, 1, 2]
    b = make_seq(1, range(5))
    assert bm.grow(b, 5) and b.block_table.tolist() == [0, 1]


def test_double_free_of_a_block_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq(0, range(4))
    assert bm.grow(a, 4)
    table = a.block_table[:]
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


# -- prefix caching ----------------------------------------------------------------------------


def test_cache_full_blocks_registers_only_computed_full_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, range(100, 110))   # 10 tokens: blocks 0, 1 full, block 2 partial
    assert bm.grow(a, 10)
    a.num_computed_tokens = 6          # a chunk ended inside block 1
    bm.cache_full_blocks(a)
    assert a.num_hashed_blocks == 1
    h0 = BlockManager.chain_hash(None, (100, 101, 102, 103))
    assert bm.blocks[0].hash == h0 and bm.blocks[0].token_ids == (100, 101, 102, 103)
    assert bm.blocks[1].hash is None and bm.blocks[2].hash is None
    assert bm.hash_to_block == {h0: 0}

    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    h1 = BlockManager.chain_hash(h0, (104, 105, 106, 107))
    assert a.num_hashed_blocks == 2
    assert bm.blocks[1].hash == h1 and bm.blocks[2].hash is None
    assert bm.hash_to_block == {h0: 0, h1: 1}

    # Generated tokens fill block 2; it is registered only once their K/V are computed.
    a.append_token(110)
    a.append_token(111)
    bm.cache_full_blocks(a)
    assert bm.blocks[2].hash is None
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    assert bm.blocks[2].hash == BlockManager.chain_hash(h1, (108, 109, 110, 111))
    assert a.num_hashed_blocks == 3 and len(bm.hash_to_block) == 3


def test_hit_shares_blocks_and_new_blocks_follow():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, range(1, 10))        # 9 tokens -> blocks 0, 1 cached, block 2 partial
    compute(bm, a)
    b = make_seq(1, [*range(1, 9), 42])  # same 8-token prefix
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_table.tolist() == [0, 1] and b.num_hashed_blocks == 2
    assert ref_counts(bm)[:3] == [2, 2, 1]
    assert bm.num_free_blocks == 5       # the shared blocks were already in use
    assert bm.grow(b, 9)
    assert b.block_table.tolist() == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]


def test_same_block_after_a_different_prefix_does_not_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block [5, 6, 7, 8] exists in the cache, but after [1, 2, 3, 4]; its K/V would be wrong here.
    b = make_seq(1, [90, 91, 92, 93, 5, 6, 7, 8, 9])
    assert bm.allocate_cached_prefix(b) == 0
    assert b.block_table.tolist() == [] and b.num_hashed_blocks == 0
    # A partial match stops at the first differing block.
    c = make_seq(2, [1, 2, 3, 4, 50, 6, 7, 8, 9])
    assert bm.allocate_cached_prefix(c) == 4 and c.block_table.tolist() == [0]
    assert ref_counts(bm)[:3] == [2, 1, 1]
    # Once b is computed, its [5, 6, 7, 8] block is a different cache entry from a's.
    compute(bm, b)
    assert b.block_table.tolist() == [3, 4, 5]
    assert bm.blocks[4].token_ids == bm.blocks[1].token_ids and bm.blocks[4].hash != bm.blocks[1].hash
    d = make_seq(3, [90, 91, 92, 93, 5, 6, 7, 8, 1])
    assert bm.allocate_cached_prefix(d) == 8 and d.block_table.tolist() == [3, 4]


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda previous, token_ids: 7))
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, make_seq(0, [1, 2, 3, 4, 5]))
    assert bm.hash_to_block == {7: 0}
    b = make_seq(1, [9, 9, 9, 9, 5])     # same (forced) hash, different tokens
    assert bm.allocate_cached_prefix(b) == 0
    assert b.block_table.tolist() == [] and bm.blocks[0].ref_count == 1
    c = make_seq(2, [1, 2, 3, 4, 6])     # same hash and the same tokens: a genuine hit
    assert bm.allocate_cached_prefix(c) == 4
    assert c.block_table.tolist() == [0] and bm.blocks[0].ref_count == 2


def test_chain_hash_is_a_digest_of_the_whole_prefix():
    # Forced collisions (above) are caught per block only; real collisions are made infeasible by
    # a cryptographic digest that covers the previous block's digest, not by the token check.
    h = BlockManager.chain_hash(None, (1, 2, 3, 4))
    assert isinstance(h, bytes) and len(h) == 16
    assert BlockManager.chain_hash(h, (1, 2, 3, 4)) != h
    assert BlockManager.chain_hash(h, (1, 2, 3, 4)) == BlockManager.chain_hash(h, (1, 2, 3, 4))
    assert BlockManager.chain_hash(None, (1, 2, 3, 4)) != BlockManager.chain_hash(b"x", (1, 2, 3, 4))
    assert BlockManager.chain_hash(None, (1, 2)) != BlockManager.chain_hash(None, (1, 2, 0))


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute(bm, make_seq(0, range(12)))  # 3 full blocks, all cached
    assert len(bm.hash_to_block) == 3
    # A prompt of exactly k cached full blocks hits k - 1 of them: the last token is always computed.
    assert bm.allocate_cached_prefix(make_seq(1, range(12))) == 8
    assert bm.allocate_cached_prefix(make_seq(2, range(8))) == 4
    assert bm.allocate_cached_prefix(make_seq(3, range(4))) == 0
    # One token past a block boundary is enough for the whole block to hit.
    d = make_seq(4, range(13))
    assert bm.allocate_cached_prefix(d) == 12 and d.block_table.tolist() == [0, 1, 2]


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(0, range(1, 10))
    compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8 and ref_counts(bm) == [0] * 8
    assert len(bm.hash_to_block) == 2
    b = make_seq(1, [*range(1, 9), 77])
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_table.tolist() == [0, 1]
    assert ref_counts(bm)[:2] == [1, 1]
    assert bm.num_free_blocks == 6       # the hit took its blocks off the free list
    assert 0 not in bm.free_blocks and 1 not in bm.free_blocks


def test_lru_reuse_order_and_eviction():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])        # blocks 0, 1 cached; 2 partial (no hash)
    b = make_seq(1, [10, 11, 12, 13, 14])   # blocks 3, 4 cached; 5 partial
    compute(bm, a)
    compute(bm, b)
    assert a.block_table.tolist() == [0, 1, 2] and b.block_table.tolist() == [3, 4, 5]
    assert bm.num_free_blocks == 0
    bm.free(a)
    bm.free(b)
    # Hash-less blocks first, then least recently freed first; one sequence's blocks tail first.
    assert list(bm.free_blocks) == [5, 2, 1, 0, 4, 3]

    c = make_seq(2, range(50, 56))
    assert bm.grow(c, 6)
    assert c.block_table.tolist() == [5, 2, 1]
    # Block 1 was a's tail: evicted, its hash mapping removed; a's head (block 0) and b survive.
    assert bm.blocks[1].hash is None and bm.blocks[1].token_ids == ()
    h0 = BlockManager.chain_hash(None, (1, 2))
    h3 = BlockManager.chain_hash(None, (10, 11))
    assert bm.hash_to_block == {h0: 0, h3: 3, BlockManager.chain_hash(h3, (12, 13)): 4}
    d = make_seq(3, [1, 2, 3, 4, 99])
    assert bm.allocate_cached_prefix(d) == 2 and d.block_table.tolist() == [0]
    e = make_seq(4, [10, 11, 12, 13, 99])
    assert bm.allocate_cached_prefix(e) == 4 and e.block_table.tolist() == [3, 4]


def test_reused_cached_block_moves_to_the_back_of_the_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [7, 8, 9])
    compute(bm, a)
    compute(bm, b)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_blocks) == [3, 1, 0, 2]
    c = make_seq(2, [1, 2, 5])           # hits a's block 0 and frees it again: now the most recent
    assert bm.allocate_cached_prefix(c) == 2
    bm.free(c)
    assert list(bm.free_blocks) == [3, 1, 2, 0]


def test_evicting_a_duplicate_keeps_the_original_mapping():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [1, 2, 3])
    # Both are computed before either registers: b's block 2 duplicates a's block 0.
    assert bm.grow(a, 3) and bm.grow(b, 3)
    for seq in (a, b):
        seq.num_computed_tokens = 3
        bm.cache_full_blocks(seq)
    h = BlockManager.chain_hash(None, (1, 2))
    assert bm.blocks[0].hash == h and bm.blocks[2].hash == h
    assert bm.hash_to_block == {h: 0}
    bm.free(b)
    # Block 3 (no hash, so at the front), then 4, 5 (never used), then the duplicate 2 is reused.
    c = make_seq(2, range(20, 28))
    assert bm.grow(c, 8) and c.block_table.tolist() == [3, 4, 5, 2]
    assert bm.hash_to_block == {h: 0}
    assert bm.allocate_cached_prefix(make_seq(3, [1, 2, 9])) == 2


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(0, range(1, 10))
    compute(bm, a)
    assert bm.hash_to_block == {} and a.num_hashed_blocks == 0
    assert all(b.hash is None for b in bm.blocks)
    b = make_seq(1, range(1, 10))
    assert bm.allocate_cached_prefix(b) == 0 and b.block_table.tolist() == []
    bm.free(a)
    assert bm.allocate_cached_prefix(b) == 0 and bm.num_free_blocks == 8
