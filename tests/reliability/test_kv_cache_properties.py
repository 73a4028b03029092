"""The block pool and KV cache manager under random operation sequences (a hypothesis state
machine): admit (prefix lookup, then allocation), grow (decode and chunk steps), fork (a second
request on a live one's tokens, as n > 1 siblings do), free, pressure (a big request that evicts
cached blocks) and reset, on a pool small enough that allocations fail and evictions happen.

After every step: free + held = usable blocks, no block is both free and held, block 0 is
never handed out, each block's reference count is the number of requests holding it, each
request holds exactly the blocks its computed tokens need, the prefix-cache index points only at
blocks that carry its hash, and a failed allocation allocates nothing. Every prefix hit is checked
against what was written into the block: the same salt and the same tokens from the start of
the sequence, not just the same block.

The same machine runs with one block table per request (most models) and with a full group
beside two sliding-window groups (Gemma 2 and 3, kv_layout.py), whose requests also hold every
block their window needs, and only null entries (released blocks) before it.
"""

from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 17  # 16 usable
# Few distinct tokens, so prompts share prefixes (and full blocks) often.
TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=24)
SALTS = st.sampled_from([None, None, "tenant-a"])


class KVCacheMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")
    GROUP_WINDOWS: tuple[int | None, ...] = (None,)
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BLOCK_SIZE, group_windows=self.GROUP_WINDOWS)
        self.live: dict[str, tuple[Request, str | None]] = {}
        # What each block's KV stands for: (group, salt, the sequence's tokens up to the block's
        # end).
        self.written: dict[int, tuple[int, str | None, tuple[int, ...]]] = {}
        self._ids = itertools.count()

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block a query at position ``num_computed`` reads in this group."""
        window = self.GROUP_WINDOWS[group]
        return 0 if window is None else max(0, num_computed - window + 1) // BLOCK_SIZE

    # ---- operations ---------------------------------------------------------------------------

    def _admit(self, tokens: list[int], salt: str | None) -> Request | None:
        req = Request(f"r{next(self._ids)}", list(tokens), SamplingParams(max_tokens=64))
        hits = self.kv.find_cached_prefix(req, salt)
        num_cached = hits.num_blocks * BLOCK_SIZE
        assert num_cached < len(tokens)  # one token is always left to compute
        for g, table in enumerate(hits.blocks):
            assert len(table) == hits.num_blocks
            for i, block in enumerate(table):
                if block.block_id == 0:  # before the window: not needed
                    assert i < self._first_needed(g, num_cached)
                    continue
                # A hit only on identical content: same salt, same tokens from the start.
                expected = (g, salt, tuple(tokens[: (i + 1) * BLOCK_SIZE]))
                assert self.written[block.block_id] == expected
        free_before = self.kv.num_free_blocks
        block_ids = self.kv.allocate_slots(req, len(tokens) - num_cached, hits, salt)
        if block_ids is None:
            assert self.kv.num_free_blocks == free_before  # all or nothing
            assert not any(self.kv.block_ids(req.req_id))
            return None
        req.num_computed_tokens = len(tokens)
        self.live[req.req_id] = (req, salt)
        self._record_written(req, salt)
        return req

    def _record_written(self, req: Request, salt: str | None) -> None:
        tokens = req.all_token_ids[: req.num_computed_tokens]
        for g, table in enumerate(self.kv.block_ids(req.req_id)):
            for i, block_id in enumerate(table):
                if block_id != 0:
                    self.written[block_id] = (g, salt, tuple(tokens[: (i + 1) * BLOCK_SIZE]))

    @rule(target=reqs, tokens=TOKENS, salt=SALTS)
    def admit(self, tokens: list[int], salt: str | None):
        req = self._admit(tokens, salt)
        return req.req_id if req is not None else "none"

    @rule(target=reqs, parent=reqs)
    def fork(self, parent: str):
        """A sibling on the same tokens (n > 1): it shares the parent's full blocks."""
        if parent not in self.live:
            return "none"
        req, salt = self.live[parent]
        shared_before = self.kv.find_cached_prefix(req, salt).blocks
        child = self._admit(req.all_token_ids, salt)
        if child is None:
            return "none"
        for child_table, shared in zip(self.kv.block_ids(child.req_id), shared_before):
            assert child_table[: len(shared)] == [b.block_id for b in shared]
        return child.req_id

    @rule(req_id=reqs, new_tokens=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def grow(self, req_id: str, new_tokens: list[int]) -> None:
        if req_id not in self.live:
            return
        req, salt = self.live[req_id]
        if req.num_tokens + len(new_tokens) > 64:
            return
        before = self.kv.block_ids(req_id)
        free_before = self.kv.num_free_blocks
        req.output_token_ids.extend(new_tokens)
        if self.kv.allocate_slots(req, len(new_tokens), None, salt) is None:
            # Nothing allocated; only blocks behind a window (no query needs them) released.
            after = self.kv.block_ids(req_id)
            num_released = sum(a != b for t, u in zip(after, before) for a, b in zip(t, u))
            assert all(a == 0 for t, u in zip(after, before) for a, b in zip(t, u) if a != b)
            assert [len(t) for t in after] == [len(t) for t in before]
            # (a released block another request shares stays held)
            assert free_before <= self.kv.num_free_blocks <= free_before + num_released
            del req.output_token_ids[-len(new_tokens) :]
            return
        req.num_computed_tokens += len(new_tokens)
        for g, (now, was) in enumerate(zip(self.kv.block_ids(req_id), before)):
            # Blocks never move; a window group's may be released (null) behind the window.
            for i, (a, b) in enumerate(zip(now, was)):
                assert a == b or (a == 0 and self.GROUP_WINDOWS[g] is not None), (g, i)
        self._record_written(req, salt)

    @rule(req_id=consumes(reqs))
    def free(self, req_id: str) -> None:
        if req_id in self.live:
            req, _ = self.live.pop(req_id)
            self.kv.free(req)
            assert not any(self.kv.block_ids(req_id))

    @rule(tokens=st.lists(st.integers(4, 9), min_size=20, max_size=60))
    def pressure(self, tokens: list[int]) -> None:
        """Fresh tokens take free blocks, cached ones included (evicting them), then leave."""
        evictions = self.kv.pool.num_evictions
        req = self._admit(tokens, None)
        if req is not None:
            assert self.kv.pool.num_evictions >= evictions
            self.live.pop(req.req_id)
            self.kv.free(req)

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self) -> None:
        assert self.kv.reset_prefix_cache()
        assert self.kv.pool._cached == {}
        assert all(b.block_hash is None for b in self.kv.pool.blocks)

    @precondition(lambda self: bool(self.live))
    @rule()
    def reset_refused_while_held(self) -> None:
        cached = dict(self.kv.pool._cached)
        assert not self.kv.reset_prefix_cache()
        assert self.kv.pool._cached == cached

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def counts_and_references(self) -> None:
        pool = self.kv.pool
        holders: dict[int, int] = {}
        for req_id, (req, _) in self.live.items():
            held = []
            for g, table in enumerate(self.kv.block_ids(req_id)):
                assert len(table) == -(-req.num_computed_tokens // BLOCK_SIZE)
                # Every block the next query's window reads is there; before it, only nulls.
                first = self._first_needed(g, req.num_computed_tokens)
                assert 0 not in table[first:]
                held += [b for b in table if b != 0]
            assert len(set(held)) == len(held)  # no block in two tables of a request
            for block_id in held:
                holders[block_id] = holders.get(block_id, 0) + 1
        free_ids = set(pool.free_block_ids())
        assert len(free_ids) == pool.num_free_blocks  # no block twice in the free queue
        assert 0 not in free_ids and 0 not in holders
        assert free_ids.isdisjoint(holders)  # no block both free and held
        assert len(free_ids) + len(holders) == pool.num_usable_blocks
        assert self.kv.num_free_blocks == len(free_ids)
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0)

    @invariant()
    def cache_index(self) -> None:
        pool = self.kv.pool
        for block_hash, block in pool._cached.items():
            assert block.block_hash == block_hash and len(block.token_ids) == BLOCK_SIZE
        assert pool.blocks[0].block_hash is None


class HybridKVCacheMachine(KVCacheMachine):
    GROUP_WINDOWS = (None, 6, 6)  # a full group and two of window 6
    NUM_BLOCKS = 41  # 40 usable: one 64-token request holds 16 + 2 x 3


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_cache_manager_invariants = KVCacheMachine.TestCase
HybridKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
test_hybrid_kv_cache_manager_invariants = HybridKVCacheMachine.TestCase
