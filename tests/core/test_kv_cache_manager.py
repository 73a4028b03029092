"""KVCacheManager: slot allocation, prefix hits (same tokens, same chain, same salt), eviction
and all-or-nothing allocation (no torch)."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager, PrefixHit
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 4
_ids = itertools.count()


def make_req(tokens: list[int]) -> Request:
    return Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8))


def admit(kv: KVCacheManager, req: Request, salt: str | None = None) -> list[int]:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest.
    Returns the first group's block ids."""
    hits = kv.find_cached_prefix(req, salt)
    num_cached = hits.num_blocks * kv.block_size
    block_ids = kv.allocate_slots(req, req.num_tokens - num_cached, hits, salt)
    assert block_ids is not None
    kv.record_prefix_query(req.num_tokens, num_cached)
    req.num_computed_tokens = req.num_tokens
    return block_ids[0]


def hit_ids(hit: PrefixHit, group: int = 0) -> list[int]:
    return [b.block_id for b in hit.blocks[group]]


def table(kv: KVCacheManager, req: Request, group: int = 0) -> list[int]:
    return kv.block_ids(req.req_id)[group]


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocate_counts_and_free():
    kv = KVCacheManager(num_blocks=9, block_size=BLOCK_SIZE)
    req = make_req(list(range(10, 20)))  # 10 tokens -> 3 blocks
    (block_ids,) = kv.allocate_slots(req, 10)
    assert len(block_ids) == 3
    assert 0 not in block_ids
    assert table(kv, req) == block_ids
    assert kv.num_free_blocks == 8 - 3
    req.num_computed_tokens = 10
    # Two more tokens fit in the partial last block; a third one needs a new block.
    assert [list(ids) for ids in kv.allocate_slots(req, 2)] == [[]]
    assert [list(ids) for ids in kv.allocate_slots(req, 3)] != [[]]
    assert len(table(kv, req)) == 4
    kv.free(req)
    assert table(kv, req) == []
    assert_all_free(kv)


def test_prefix_hit_needs_same_tokens_and_same_chain():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    a = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9])
    a_blocks = admit(kv, a)
    kv.free(a)

    same = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    hits = kv.find_cached_prefix(same)
    assert hit_ids(hits) == a_blocks[:2]

    # The second block's tokens match, but its chain (first block) does not: no hit at all.
    other_head = make_req([1, 2, 3, 99, 5, 6, 7, 8, 9])
    assert kv.find_cached_prefix(other_head).num_blocks == 0

    # Same first block, different second block: only the first hits.
    other_tail = make_req([1, 2, 3, 4, 5, 6, 7, 99, 9])
    assert hit_ids(kv.find_cached_prefix(other_tail)) == a_blocks[:1]

    # Partial blocks are never cached.
    short = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert kv.find_cached_prefix(short).num_blocks == 2
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
    assert kv.find_cached_prefix(make_req(tokens)).num_blocks == 0
    assert kv.find_cached_prefix(make_req(tokens), "bob").num_blocks == 0
    hits = kv.find_cached_prefix(make_req(tokens), "alice")
    assert hit_ids(hits) == a_blocks[:2]
    # And unsalted blocks are not found with a salt.
    c = make_req([50, 51, 52, 53, 54])
    admit(kv, c)
    kv.free(c)
    assert kv.find_cached_prefix(make_req([50, 51, 52, 53, 54])).num_blocks == 1
    assert kv.find_cached_prefix(make_req([50, 51, 52, 53, 54]), "alice").num_blocks == 0
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
    assert hits.num_blocks == num_hit_blocks
    assert hits.num_blocks * BLOCK_SIZE < num_tokens
    block_ids = kv.allocate_slots(b, num_tokens - hits.num_blocks * BLOCK_SIZE, hits)
    assert len(table(kv, b)) == -(-num_tokens // BLOCK_SIZE)
    assert block_ids[0][:num_hit_blocks] == hit_ids(hits)
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
    [[evicted]] = kv.allocate_slots(filler2, 2)
    assert evicted == a_blocks[2]
    assert kv.pool.num_evictions == 1
    b = make_req(tokens + [77])
    hits = kv.find_cached_prefix(b)
    assert hit_ids(hits) == a_blocks[:2]
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
    assert table(kv, b) == []
    assert kv.num_free_blocks == 1
    # A running request that grows past the free blocks keeps what it had.
    a_blocks = table(kv, a)
    assert kv.allocate_slots(a, 8) is None
    assert table(kv, a) == a_blocks
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
    assert hits.num_blocks == 2 and all(h.ref_cnt == 0 for h in hits.held())
    assert kv.allocate_slots(b, 17 - 8, hits) is None
    assert kv.num_free_blocks == free_before
    assert all(h.ref_cnt == 0 for h in hits.held())
    assert table(kv, b) == []
    kv.free(holder)
    assert_all_free(kv)


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    tokens = list(range(1, 10))
    a = make_req(tokens)
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.find_cached_prefix(make_req(tokens)).num_blocks == 2
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.find_cached_prefix(make_req(tokens)).num_blocks == 0
    assert_all_free(kv)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    tokens = list(range(1, 10))
    a = make_req(tokens)
    admit(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(make_req(tokens)).num_blocks == 0
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
    assert hits.num_blocks == 2


def _decode(kv: KVCacheManager, req: Request, steps: int) -> None:
    for step in range(steps):
        req.output_token_ids.append(1000 + step)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def test_every_layer_windowed_releases_blocks_before_the_window():
    window = 6
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, group_windows=(window,))
    req = make_req(list(range(10, 30)))  # a 20-token prompt in 5 blocks
    admit(kv, req)
    _decode(kv, req, 30)
    held = table(kv, req)
    # The next query sits at position 50 and sees keys 45..50: blocks 11 and 12 (of 4 tokens).
    # Every block before them is released to the null block 0; they and the last stay.
    first_needed = (req.num_computed_tokens - window + 1) // BLOCK_SIZE
    assert held[:first_needed] == [0] * first_needed
    assert 0 not in held[first_needed:]
    assert kv.num_free_blocks == kv.pool.num_usable_blocks - len(held[first_needed:])
    kv.free(req)
    assert_all_free(kv)


def test_a_windowed_request_outlives_a_pool_smaller_than_its_context():
    # 7 usable blocks hold 28 tokens; with a window of 6 a request (at most 3 blocks: the
    # window and the new token straddle 3 blocks of 4) runs to 58 tokens, beside another.
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, group_windows=(6,))
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
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, group_windows=(4,))
    prompt = list(range(10, 26))  # 4 full blocks
    first = make_req(prompt)
    admit(kv, first)
    _decode(kv, first, 8)
    assert table(kv, first)[0] == 0  # released from the first request's table
    second = make_req(prompt)
    assert kv.find_cached_prefix(second).num_blocks == 3  # yet still cached (one token left to run)
    kv.free(first)
    assert_all_free(kv)


def test_without_a_window_blocks_stay():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    req = make_req(list(range(10, 30)))
    admit(kv, req)
    _decode(kv, req, 30)
    assert 0 not in table(kv, req)
    kv.free(req)
    assert_all_free(kv)


# ---- hybrid layouts: a full-attention group beside window groups (Gemma 2 and 3) -------------

HYBRID = (None, 6, 6)  # one full group, two groups of window-6 layers


def test_hybrid_full_group_keeps_every_block_window_groups_only_their_window():
    kv = KVCacheManager(num_blocks=40, block_size=BLOCK_SIZE, group_windows=HYBRID)
    req = make_req(list(range(10, 30)))  # 20 tokens, 5 blocks in every group
    admit(kv, req)
    assert [len(t) for t in kv.block_ids(req.req_id)] == [5, 5, 5]
    assert kv.num_free_blocks == 39 - 15
    _decode(kv, req, 30)  # 50 tokens: 13 blocks; the next query (position 50) sees 45..50
    full, *windows = kv.block_ids(req.req_id)
    assert len(full) == 13 and 0 not in full
    first_needed = (50 - 6 + 1) // BLOCK_SIZE
    for t in windows:
        assert t[:first_needed] == [0] * first_needed
        assert 0 not in t[first_needed:]
    # Every block id is held once: no group shares a block with another.
    held = [b for t in kv.block_ids(req.req_id) for b in t if b]
    assert len(held) == len(set(held))
    assert kv.num_free_blocks == 39 - 13 - 2 * (13 - first_needed)
    kv.free(req)
    assert_all_free(kv)


def test_hybrid_prefix_hit_takes_the_full_blocks_and_the_windows():
    kv = KVCacheManager(num_blocks=60, block_size=BLOCK_SIZE, group_windows=HYBRID)
    prompt = list(range(10, 34))  # 24 tokens: 6 full blocks
    first = make_req(prompt)
    admit(kv, first)
    second = make_req(prompt + [99])
    hit = kv.find_cached_prefix(second)
    assert hit.num_blocks == 6
    assert hit_ids(hit, 0) == table(kv, first, 0)
    # The query at position 24 sees keys 19..24: window blocks 4 and 5; the rest are null.
    for g in (1, 2):
        assert hit_ids(hit, g) == [0, 0, 0, 0] + table(kv, first, g)[4:6]
    new = kv.allocate_slots(second, 1, hit)
    assert [len(t) for t in new] == [7, 7, 7]  # the hit's entries and one fresh block each
    assert [kv.pool.blocks[i].ref_cnt for i in table(kv, first, 1)] == [1, 1, 1, 1, 2, 2]
    kv.free(first)
    kv.free(second)
    assert_all_free(kv)


def test_hybrid_hit_needs_its_window_still_cached():
    # 34 usable blocks: a request of 40 tokens holds 10 full blocks and 2 per window group,
    # and its 2 x 8 released window blocks and 4 never used ones are free.
    kv = KVCacheManager(num_blocks=35, block_size=BLOCK_SIZE, group_windows=HYBRID)
    prompt = list(range(10, 34))  # 6 full blocks
    first = make_req(prompt)
    admit(kv, first)
    _decode(kv, first, 16)
    assert kv.num_free_blocks == 34 - 10 - 2 * 2
    # The context so far: its windows are the live blocks the first request holds (its last
    # block, filled by the last step, is hashed by the next: see the tests below).
    assert kv.find_cached_prefix(make_req(first.all_token_ids + [1])).num_blocks == 9
    # The prompt again: its window (blocks 4 and 5) was released, but is still cached.
    assert kv.find_cached_prefix(make_req(prompt + [1])).num_blocks == 6
    # Once those blocks are handed out (never used ones first, then the oldest released), the
    # prompt's full blocks alone are no hit: its window layers would have no K/V to attend to.
    filler = make_req(list(range(500, 524)))
    assert kv.allocate_slots(filler, 24) is not None  # 6 blocks in each of the 3 groups
    assert kv.num_free_blocks == 2
    assert kv.find_cached_prefix(make_req(prompt + [1])).num_blocks == 0
    kv.free(filler)
    kv.free(first)
    assert_all_free(kv)


def test_hybrid_allocation_is_all_or_nothing_over_groups():
    # 9 usable blocks: a 12-token request takes 3 per group, a second one finds none.
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, group_windows=HYBRID)
    a = make_req(list(range(1, 13)))
    admit(kv, a)
    assert kv.num_free_blocks == 0
    b = make_req([7, 8])
    assert kv.allocate_slots(b, 2) is None
    assert kv.block_ids(b.req_id) == [[], [], []]
    kv.free(a)
    assert_all_free(kv)


def test_a_block_filled_while_decoding_is_hashed_by_the_next_growth_or_as_freed():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    first = make_req(list(range(10, 16)))  # 6 tokens: block 0 full, hashed as it is scheduled
    admit(kv, first)
    _decode(kv, first, 2)  # block 1 fills: no call of its own hashes it
    assert kv.find_cached_prefix(make_req(first.all_token_ids + [1])).num_blocks == 1
    _decode(kv, first, 1)  # the tables grow past it: hashed then
    assert kv.find_cached_prefix(make_req(first.all_token_ids[:8] + [1])).num_blocks == 2
    # A request that ends right as a block fills leaves it findable all the same.
    second = make_req(list(range(50, 56)))
    admit(kv, second)
    _decode(kv, second, 2)
    kv.free(second)
    assert kv.find_cached_prefix(make_req(second.all_token_ids + [1])).num_blocks == 2
    kv.free(first)
    assert_all_free(kv)


def test_a_salted_request_freed_as_its_first_block_fills_hashes_it_with_its_salt():
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    req = make_req([10, 11])  # a prompt shorter than a block: its first block fills decoding
    admit(kv, req, salt="tenant-a")
    _decode(kv, req, 2)
    kv.free(req, "tenant-a")
    probe = req.all_token_ids + [1]
    assert kv.find_cached_prefix(make_req(probe), "tenant-a").num_blocks == 1
    assert kv.find_cached_prefix(make_req(probe), "tenant-b").num_blocks == 0
    assert kv.find_cached_prefix(make_req(probe)).num_blocks == 0
