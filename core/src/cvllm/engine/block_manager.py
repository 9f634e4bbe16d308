"""Paged KV blocks: a free list, reference counts and prefix caching (pure Python, no torch).

A full block's hash chains the previous block's hash with its own token ids, so equal hashes
mean equal prefixes. The hash is a cryptographic digest (blake2b), not Python's ``hash``: a
crafted prompt must not be able to collide with another user's prefix and read its KV (vLLM
moved to SHA-256 for the same reason). The stored token ids are compared on a hit as well.
Freed blocks keep their hash and stay findable until reused, least recently freed first (LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from cvllm.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self.hash_to_block: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @staticmethod
    def chain_hash(previous: bytes | None, token_ids: tuple[int, ...]) -> bytes:
        digest = hashlib.blake2b(previous or b"", digest_size=16)
        digest.update(array("q", token_ids).tobytes())
        return digest.digest()

    # -- allocation ----------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict the cached content this block held
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest cached prefix; returns the tokens hit.

        Only blocks wholly inside the first ``num_tokens - 1`` tokens count, so at least one token
        is always computed (its logits are needed) and no shared block is ever written to.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        bs, h = self.block_size, None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.chain_hash(h, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(seq.block_table)
        return len(seq.block_table) * bs

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq``'s block table cover ``num_tokens`` tokens; all or nothing."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # only blocks whose tokens are all known: the last token may still be on the device (async scheduling)
        full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // bs, len(seq.block_table))
        if full <= seq.num_hashed_blocks:   # the common case: no block filled up this step
            return
        h = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else None
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block.hash = self.chain_hash(h, block.token_ids)
            self.hash_to_block.setdefault(h, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, last block first, so a chain's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_blocks[block_id] = None
                    self.free_blocks.move_to_end(block_id, last=False)  # holds nothing: reuse first
                else:
                    self.free_blocks[block_id] = None
        seq.block_table = array("i")
        seq.num_hashed_blocks = 0
