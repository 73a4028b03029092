"""BlockPool: counts, reference counts, block 0, LRU eviction order and reset (no torch)."""

from __future__ import annotations

import pytest

from tokenmill.core.block_pool import BlockPool, hash_block_tokens


def cache(pool: BlockPool, block, tokens: tuple[int, ...], parent: bytes | None = None) -> bytes:
    block_hash = hash_block_tokens(parent, tokens)
    pool.cache_block(block, block_hash, tokens)
    return block_hash


def test_allocate_and_free_counts():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.usage == pytest.approx(0.75)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert [b.ref_cnt for b in blocks] == [0, 0, 0]
    assert pool.usage == 0.0


def test_block_zero_is_never_handed_out():
    pool = BlockPool(5)
    for _ in range(3):
        blocks = pool.allocate(4)
        assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
        pool.free(blocks)


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, only 1"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.free(held)
    assert pool.num_free_blocks == 3


def test_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_ref_counts_with_touch():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    tokens = (5, 6, 7, 8)
    block_hash = cache(pool, block, tokens)
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2  # still held by one request
    pool.free([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 3
    # Free but still cached: a hit takes it back out of the free queue.
    assert pool.get_cached_block(block_hash, tokens) is block
    pool.touch([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2
    pool.free([block])


def test_double_free_is_caught():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([block])


def test_lru_order_uncached_first_then_chain_tail_before_head():
    pool = BlockPool(5)
    b1, b2, b3, b4 = pool.allocate(4)
    h1 = cache(pool, b1, (1, 2))
    h2 = cache(pool, b2, (3, 4), parent=h1)
    # A request frees its chain tail first (as KVCacheManager.free does).
    pool.free([b2, b1])
    pool.free([b3, b4])  # uncached: worthless, reused first
    first_two = pool.allocate(2)
    assert {b.block_id for b in first_two} == {b3.block_id, b4.block_id}
    assert pool.num_evictions == 0
    assert pool.get_cached_block(h1, (1, 2)) is b1
    assert pool.get_cached_block(h2, (3, 4)) is b2
    # The chain's tail goes before its head.
    (third,) = pool.allocate(1)
    assert third is b2
    assert pool.num_evictions == 1
    assert pool.get_cached_block(h2, (3, 4)) is None
    assert b2.block_hash is None and b2.token_ids == ()
    assert pool.get_cached_block(h1, (1, 2)) is b1
    (fourth,) = pool.allocate(1)
    assert fourth is b1
    assert pool.get_cached_block(h1, (1, 2)) is None
    assert pool.num_evictions == 2
    pool.free(first_two + [third, fourth])
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    ha = cache(pool, a, (1,))
    hb = cache(pool, b, (2,))
    hc = cache(pool, c, (3,))
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert [x.block_id for x in pool.allocate(1)] == [b.block_id]
    assert pool.get_cached_block(hb, (2,)) is None
    assert pool.get_cached_block(ha, (1,)) is a
    assert pool.get_cached_block(hc, (3,)) is c


def test_cached_lookup_checks_tokens_too():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    block_hash = cache(pool, block, (1, 2, 3))
    assert pool.get_cached_block(block_hash, (1, 2, 3)) is block
    assert pool.get_cached_block(block_hash, (1, 2, 4)) is None
    assert pool.get_cached_block(hash_block_tokens(None, (1, 2, 4)), (1, 2, 4)) is None
    pool.free([block])


def test_first_writer_wins_on_duplicate_hash():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    block_hash = cache(pool, a, (9, 9))
    pool.cache_block(b, block_hash, (9, 9))
    assert b.block_hash is None
    assert pool.get_cached_block(block_hash, (9, 9)) is a
    pool.free([a, b])


def test_hash_is_chained_and_salted():
    root = hash_block_tokens(None, (1, 2))
    assert hash_block_tokens(None, (1, 2)) == root
    assert hash_block_tokens(root, (3, 4)) != hash_block_tokens(None, (3, 4))
    assert hash_block_tokens(None, (1, 2), "salt") != root
    assert hash_block_tokens(None, (1, 2), "a") != hash_block_tokens(None, (1, 2), "b")


def test_caching_disabled_keeps_no_hashes():
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.allocate(1)
    block_hash = hash_block_tokens(None, (1,))
    pool.cache_block(block, block_hash, (1,))
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash, (1,)) is None
    pool.free([block])


def test_reset_prefix_cache_refused_while_blocks_are_held():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    ha = cache(pool, a, (1,))
    pool.free([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(ha, (1,)) is a  # nothing was forgotten
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(ha, (1,)) is None
    assert a.block_hash is None
    assert pool.num_free_blocks == pool.num_usable_blocks
