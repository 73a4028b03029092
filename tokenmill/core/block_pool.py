"""BlockPool: the KV cache's fixed-size blocks, their reference counts and the prefix-cache index.

A block is free when no request holds it (``ref_cnt == 0``). Free blocks wait in an LRU queue;
a free block that still carries a hash stays findable in the prefix cache until it is handed out
again, at which point its hash is dropped (eviction). Requests release their blocks tail first,
so the end of a chain is evicted before its start and a later request still finds the prefix.

The free queue, in the order blocks are handed out::

    | freed without a hash, newest first | never handed out, by id | freed with a hash, LRU |

Blocks are made when first handed out: a GPU's cache has millions (2.7M for gemma-3-270m on
an H200), which as objects up front took 4.2 s and ~600 MB of host memory at start-up.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None
) -> BlockHash:
    """Hash of a full block, chained from its parent's hash (sha256, so no practical collisions)."""
    h = hashlib.sha256(parent_hash or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_key:
        h.update(b"\x00salt:" + extra_key.encode())
    return h.digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The tokens whose KV the block holds; a hash hit is only used when they match too.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Owns every KV block. Block 0 is never handed out: padded block tables point at it."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # The blocks handed out so far (block i is blocks[i]); the rest are free and fresh.
        self.blocks = [Block(0)]
        self._reuse: list[int] = []  # freed without a hash: the last is handed out first
        self._lru: OrderedDict[int, None] = OrderedDict()  # freed with a hash, oldest first
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._reuse) + self._num_fresh + len(self._lru)

    @property
    def _num_fresh(self) -> int:
        return self.num_blocks - len(self.blocks)

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they would be handed out (for tests: O(blocks))."""
        fresh = range(len(self.blocks), self.num_blocks)
        return [*reversed(self._reuse), *fresh, *self._lru]

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` blocks from the LRU end of the free queue (evicting their hashes)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        out = []
        for _ in range(num_blocks):
            if self._reuse:
                block = self.blocks[self._reuse.pop()]
            elif self._num_fresh:
                block = Block(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.blocks[self._lru.popitem(last=False)[0]]
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._lru[block.block_id]  # a hit: it has a hash
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block; pass a chain tail first so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Uncached blocks are worthless once free: reuse them before any other.
                    self._reuse.append(block.block_id)
                else:
                    self._lru[block.block_id] = None

    def cache_block(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None
        block.token_ids = ()
