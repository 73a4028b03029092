"""KVCacheManager: slot allocation, prefix hits (same tokens, same chain, same salt), eviction
and all-or-nothing allocation (no torch)."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager, max_blocks_held
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 4
_ids = itertools.count()


def make_req(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, req: Request, salt: str | None = None) -> list[int]:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hits = kv.find_cached_prefix(req, salt)
    num_cached = len(hits) * kv.block_size
    block_ids = kv.allocate_slots(req, req.num_tokens - num_cached, hits, salt)
    assert block_ids is not None
    kv.record_prefix_query(req.num_tokens, num_cached)
    req.num_computed_tokens = req.num_tokens
    return block_ids


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocate_counts_and_free():
    kv = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE)
    req = make_req(list(range(10, 20)))  # 10 tokens -> 3 blocks
    block_ids = kv.allocate_slots(req, 10)
    assert len(block_ids) == 3
    assert 0 not in block_ids
    assert kv.block_ids(req.req_id) == block_ids
    assert kv.num_free_blocks == 8 - 3
    req.num_computed_tokens = 10
    # Two more tokens fit in the partial last block; a third one needs a new block.
    assert kv.allocate_slots(req, 2) == []
    assert kv.allocate_slots(req, 3) != []
    assert len(kv.block_ids(req.req_id)) == 4
    kv.free(req)
    assert kv.block_ids(req.req_id) == []
    assert_all_free(kv)


def test_prefix_hit_needs_same_tokens_and_same_chain():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    a = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9])
    a_blocks = admit(kv, a)
    kv.free(a)

    same = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    hits = kv.find_cached_prefix(same)
    assert [b.block_id for b in hits] == a_blocks[:2]

    # The second block's tokens match, but its chain (first block) does not: no hit at all.
    other_head = make_req([1, 2, 3, 99, 5, 6, 7, 8, 9])
    assert kv.find_cached_prefix(other_head) == []

    # Same first block, different second block: only the first hits.
    other_tail = make_req([1, 2, 3, 4, 5, 6, 7, 99, 9])
    assert [b.block_id for b in kv.find_cached_prefix(other_tail)] == a_blocks[:1]

    # Partial blocks are never cached.
    short = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert len(kv.find_cached_prefix(short)) == 2
    assert_all_free(kv)


def test_prefix_hit_shares_blocks_and_ref_counts():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    a = make_req(list(range(1, 10)))
    a_blocks = admit(kv, a)
    b = make_req(list(range(1, 10)))
    b_blocks = admit(kv, b)  # while a still holds its blocks
    assert b_blocks[:2] == a_blocks[:2]
    assert b_blocks[2] != a_blocks[2]  # the partial last block is private
    assert [kv.pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 1]
    assert kv.num_free_blocks == 19 - 4
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in b_blocks] == [1, 1, 1]
    kv.free(b)
    assert_all_free(kv)


def test_hit_counters():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    a = make_req(list(range(1, 10)))
    admit(kv, a)
    kv.free(a)
    b = make_req(list(range(1, 10)))
    admit(kv, b)
    kv.free(b)
    assert kv.num_queried_tokens == 18
    assert kv.num_hit_tokens == 8


def test_cache_salt_isolates_prefixes():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    tokens = list(range(1, 10))
    a = make_req(tokens)
    a_blocks = admit(kv, a, salt="alice")
    kv.free(a)
    assert kv.find_cached_prefix(make_req(tokens)) == []
    assert kv.find_cached_prefix(make_req(tokens), "bob") == []
    hits = kv.find_cached_prefix(make_req(tokens), "alice")
    assert [b.block_id for b in hits] == a_blocks[:2]
    # And unsalted blocks are not found with a salt.
    c = make_req([50, 51, 52, 53, 54])
    admit(kv, c)
    kv.free(c)
    assert len(kv.find_cached_prefix(make_req([50, 51, 52, 53, 54]))) == 1
    assert kv.find_cached_prefix(make_req([50, 51, 52, 53, 54]), "alice") == []
    assert_all_free(kv)


@pytest.mark.parametrize("num_tokens, num_hit_blocks", [(8, 1), (9, 2), (12, 2), (4, 0), (5, 1)])
def test_hit_leaves_at_least_one_token_to_compute(num_tokens, num_hit_blocks):
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    tokens = list(range(100, 100 + num_tokens))
    a = make_req(tokens)
    admit(kv, a)
    kv.free(a)
    b = make_req(tokens)
    hits = kv.find_cached_prefix(b)
    assert len(hits) == num_hit_blocks
    assert len(hits) * BLOCK_SIZE < num_tokens
    block_ids = kv.allocate_slots(b, num_tokens - len(hits) * BLOCK_SIZE, hits)
    assert len(kv.block_ids(b.req_id)) == -(-num_tokens // BLOCK_SIZE)
    assert block_ids[:num_hit_blocks] == [h.block_id for h in hits]
    kv.free(b)
    assert_all_free(kv)


def test_hit_after_eviction_of_chain_tail_finds_head():
    # 6 usable blocks; a 12-token chain fills 3 of them.
    kv = KVCacheManager(num_blocks=7, block_size=BLOCK_SIZE)
    tokens = list(range(1, 13))
    a = make_req(tokens + [13])  # 3 full blocks + 1 token
    a_blocks = admit(kv, a)
    kv.free(a)
    assert kv.pool.num_evictions == 0
    # Take 3 blocks: the 2 never-used ones and a's uncached partial block go first ...
    filler = make_req(list(range(200, 212)))
    assert kv.allocate_slots(filler, 12) is not None
    assert kv.pool.num_evictions == 0
    # ... then one more block evicts the chain's tail (block 3 of a), not its head.
    filler2 = make_req([300, 301])
    (evicted,) = kv.allocate_slots(filler2, 2)
    assert evicted == a_blocks[2]
    assert kv.pool.num_evictions == 1
    b = make_req(tokens + [77])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == a_blocks[:2]
    kv.free(filler)
    kv.free(filler2)
    assert_all_free(kv)


def test_allocate_slots_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable
    a = make_req(list(range(1, 13)))  # 3 blocks
    admit(kv, a)
    before = [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.pool.blocks]
    b = make_req(list(range(50, 58)))  # needs 2 blocks, 1 free
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids(b.req_id) == []
    assert kv.num_free_blocks == 1
    # A running request that grows past the free blocks keeps what it had.
    a_blocks = kv.block_ids(a.req_id)
    assert kv.allocate_slots(a, 8) is None
    assert kv.block_ids(a.req_id) == a_blocks
    assert [(x.block_id, x.ref_cnt, x.block_hash) for x in kv.pool.blocks] == before
    kv.free(b)  # freeing a request that holds nothing is harmless
    kv.free(a)
    assert_all_free(kv)


def test_evictable_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable
    tokens = list(range(1, 10))
    a = make_req(tokens)
    admit(kv, a)  # 3 blocks, 2 of them cached
    kv.free(a)
    holder = make_req([90, 91, 92, 93, 94])
    assert kv.allocate_slots(holder, 5) is not None  # takes 2 (uncached block + 1 more)
    free_before = kv.num_free_blocks
    b = make_req(tokens + list(range(20, 28)))  # 17 tokens: 2 hit blocks + 3 new
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2 and all(h.ref_cnt == 0 for h in hits)
    assert kv.allocate_slots(b, 17 - 8, hits) is None
    assert kv.num_free_blocks == free_before
    assert all(h.ref_cnt == 0 for h in hits)
    assert kv.block_ids(b.req_id) == []
    kv.free(holder)
    assert_all_free(kv)


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    tokens = list(range(1, 10))
    a = make_req(tokens)
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert len(kv.find_cached_prefix(make_req(tokens))) == 2
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.find_cached_prefix(make_req(tokens)) == []
    assert_all_free(kv)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    tokens = list(range(1, 10))
    a = make_req(tokens)
    admit(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(make_req(tokens)) == []
    assert_all_free(kv)


def test_output_tokens_are_cached_once_their_block_is_full():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a = make_req([1, 2, 3, 4, 5, 6])
    admit(kv, a)
    # Decode two tokens: the second block fills with output tokens 7 and 8.
    for token in (7, 8):
        a.output_token_ids.append(token)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    kv.free(a)
    hits = kv.find_cached_prefix(make_req([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert len(hits) == 2


def _decode(kv: KVCacheManager, req: Request, steps: int) -> None:
    for step in range(steps):
        req.output_token_ids.append(1000 + step)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def test_every_layer_windowed_releases_blocks_before_the_window():
    window = 6
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, sliding_window=window)
    req = make_req(list(range(10, 30)))  # a 20-token prompt in 5 blocks
    admit(kv, req)
    _decode(kv, req, 30)
    table = kv.block_ids(req.req_id)
    # The next query sits at position 50 and sees keys 45..50: blocks 11 and 12 (of 4 tokens).
    # Every block before them is released to the null block 0; they and the last stay.
    first_needed = (req.num_computed_tokens - window + 1) // BLOCK_SIZE
    assert table[:first_needed] == [0] * first_needed
    assert 0 not in table[first_needed:]
    assert kv.num_free_blocks == kv.pool.num_usable_blocks - len(table[first_needed:])
    kv.free(req)
    assert_all_free(kv)


def test_a_windowed_request_outlives_a_pool_smaller_than_its_context():
    # 7 usable blocks hold 28 tokens; with a window of 6 a request (at most 3 blocks: the
    # window and the new token straddle 3 blocks of 4) runs to 58 tokens, beside another.
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, sliding_window=6)
    a, b = make_req(list(range(10, 18))), make_req(list(range(50, 54)))
    admit(kv, a)
    admit(kv, b)
    for _ in range(50):
        _decode(kv, a, 1)
        _decode(kv, b, 1)
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_released_blocks_stay_findable_until_reused():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, sliding_window=4)
    prompt = list(range(10, 26))  # 4 full blocks
    first = make_req(prompt)
    admit(kv, first)
    _decode(kv, first, 8)
    assert kv.block_ids(first.req_id)[0] == 0  # released from the first request's table
    second = make_req(prompt)
    assert len(kv.find_cached_prefix(second)) == 3  # yet still cached (one token left to run)
    kv.free(first)
    assert_all_free(kv)


def test_without_a_window_blocks_stay():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    req = make_req(list(range(10, 30)))
    admit(kv, req)
    _decode(kv, req, 30)
    assert 0 not in kv.block_ids(req.req_id)
    kv.free(req)
    assert_all_free(kv)


def test_max_blocks_held_with_and_without_a_window():
    assert max_blocks_held(16, 4096, 2048, None) == 256
    # A 4,096-token window behind a 2,048-token step: 6,143 tokens over blocks of 16.
    assert max_blocks_held(16, 32768, 2048, 4096) == 385
    assert max_blocks_held(16, 1024, 2048, 4096) == 64  # never more than the whole context
