"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Block layout of one request's table (block_size = 4 here)::

    | computed (cached or run) | scheduled this step | free room |
    [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 .. ..]
      full, hashed   full, hashed  partial: never hashed

Full blocks are hashed (chained, see block_pool) as their tokens are scheduled: a prompt's at
once, a block that fills while decoding by the step that grows the tables past it (the next one)
or as the request's blocks are freed. Steps run in order, so by the next lookup their KV is
written.

A request has one table per group of layers (kv_layout.py): one for most models, and for Gemma
2 and 3 one for the full-attention layers and one per group of sliding-window layers. Every
table covers the same tokens, block for block. In a window group, a block whose tokens all lie
before the window of the request's next query is released: its table entry becomes the null
block 0, which no kernel reads (they read only the window), and the block goes back to the pool,
still findable by its hash until it is handed out again (in LRU order, as any freed cached
block: another request with the same prefix may still need its window). A window group thus
holds at most window + step tokens of blocks however long the request runs.

A prefix hit covers the same leading blocks in every group: all of them in a full group, and in a
window group those the window of the first token left to compute reaches (the blocks before it
were released, and are not needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.core.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from tokenmill.request import Request

NULL_BLOCK = 0  # block_pool never hands it out; released window blocks' table entries


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks a waiting request starts from: its first ``num_blocks`` blocks of tokens,
    per group (a window group's entries before its window are the null block)."""

    num_blocks: int
    blocks: list[list[Block]]

    def held(self) -> list[Block]:
        """The blocks the hit takes a reference on (not the null entries)."""
        return [b for table in self.blocks for b in table if b.block_id != NULL_BLOCK]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = group_windows
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[list[Block]]] = {}  # per request, per group
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a request already registered
        # Per running request, until when its next allocate_slots has nothing to do (see
        # _quiet_bounds): most decode steps, which then cost a lookup and two comparisons.
        self._quiet: dict[str, tuple[int, int]] = {}
        # Each window size and its groups.
        sizes = dict.fromkeys(w for w in group_windows if w is not None)
        self._windows = [(w, [g for g, x in enumerate(group_windows) if x == w]) for w in sizes]
        self._group_suffixes = [_group_key(b"", g) for g in range(len(group_windows))]
        # What allocate_slots returns for a request that needs no new block, most calls: one
        # shared immutable value rather than fresh lists each time.
        self._no_new_blocks: tuple[tuple[int, ...], ...] = tuple(() for _ in group_windows)
        # Prefix-cache counters, in tokens (what /metrics reports).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, req_id: str) -> list[list[int]]:
        """The request's block table of each group (empty ones if it holds none)."""
        tables = self._req_blocks.get(req_id) or [[] for _ in self.group_windows]
        return [[b.block_id for b in table] for table in tables]

    def find_cached_prefix(self, req: Request, cache_salt: str | None = None) -> PrefixHit:
        """The longest run of cached full blocks that starts the request's tokens, in every group.

        At least one token is always left to compute, since the model must run on the last one
        to produce the next token's logits.

        NOTE: a request that wants prompt log-probs takes no hits (as in vLLM): the logits of every
        prompt position are needed, so its whole prompt runs. Its full blocks are still cached
        for others. So does an embedding request that pools every position (mean, cls).
        """
        none = PrefixHit(0, [[] for _ in self.group_windows])
        if not self.enable_caching or req.needs_every_position:
            return none
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._hashes(req, max_blocks, cache_salt)
        found: dict[tuple[int, int], Block | None] = {}

        def cached(group: int, i: int) -> Block | None:
            if (group, i) not in found:
                chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
                key = _group_key(hashes[i], group)
                found[group, i] = self.pool.get_cached_block(key, chunk)
            return found[group, i]

        # Full groups: the run of cached blocks from the first one.
        num_blocks = max_blocks
        for g, window in enumerate(self.group_windows):
            if window is None:
                num_blocks = next(
                    (i for i in range(num_blocks) if cached(g, i) is None), num_blocks
                )
        # Window groups: the longest run whose window is cached. A miss at block i rules out
        # every run longer than i (its window reaches block i or a later miss).
        while num_blocks > 0:
            miss = None
            for g, window in enumerate(self.group_windows):
                if window is None:
                    continue
                first = self._first_needed(g, num_blocks)
                miss = next(
                    (i for i in range(num_blocks - 1, first - 1, -1) if cached(g, i) is None), None
                )
                if miss is not None:
                    break
            if miss is None:
                break
            num_blocks = miss
        if num_blocks == 0:
            return none
        null = self.pool.blocks[NULL_BLOCK]
        blocks = []
        for g in range(self.num_groups):
            first = self._first_needed(g, num_blocks)
            table = [null] * first + [cached(g, i) for i in range(first, num_blocks)]
            blocks.append(table)  # type: ignore[arg-type]
        return PrefixHit(num_blocks, blocks)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was then scheduled (retries of a request that did not
        fit are not counted again)."""
        if self.enable_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        cache_salt: str | None = None,
    ) -> Sequence[Sequence[int]] | None:
        """Make room for ``num_new_tokens`` more tokens; None if blocks run out (nothing is then
        allocated; blocks behind a window are released all the same: no query needs them).

        ``hit`` is the prefix hit of a request that holds no blocks yet. Returns the ids of each
        group's new table entries (the hit's, null ones included, then fresh blocks).
        """
        num_computed = req.num_computed_tokens
        quiet = self._quiet.get(req.req_id)
        if quiet and num_computed < quiet[0] and num_computed + num_new_tokens <= quiet[1]:
            return self._no_new_blocks
        tables = self._req_blocks.get(req.req_id)
        if tables is None:  # a new or resumed request: its hit's blocks, then fresh ones
            tables = self._req_blocks[req.req_id] = [[] for _ in self.group_windows]
            return self._allocate(req, tables, num_new_tokens, hit or self._no_hit(), cache_salt)
        # A running request (most calls: one token a step, rarely a new block).
        assert hit is None, "a prefix hit is for a request that holds no blocks yet"
        self._release_behind_windows(tables, num_computed)
        num_tokens = num_computed + num_new_tokens
        if len(tables[0]) * self.block_size >= num_tokens:  # tables all cover as much
            self._cache_full_blocks(req, num_tokens, cache_salt)
            new_ids: Sequence[Sequence[int]] | None = self._no_new_blocks
        else:
            new_ids = self._grow(req, tables, num_tokens, cache_salt)
        if new_ids is not None:
            self._quiet[req.req_id] = self._quiet_bounds(len(tables[0]), num_computed)
        return new_ids

    def _quiet_bounds(self, num_table_blocks: int, num_computed: int) -> tuple[int, int]:
        """(c, e): a running request's next allocate_slots, from ``num_computed_tokens`` below c
        up to ``num_computed + num_new`` of at most e, would do nothing, so it may return at
        once. Its two jobs wait for a block boundary:
        - no window moves past a block (its first needed block stays that of ``num_computed``);
        - the tables hold the tokens (``num_table_blocks`` blocks each).
        A block that fills is hashed by the call that does either (the next table's growth, a
        step later, at the latest) or as the request's blocks are freed: not by a call of its
        own, which cost a third of these calls' time (one a block of every request).
        """
        bs = self.block_size
        first_unquiet = 1 << 62
        for window, _ in self._windows:
            first_needed = max(0, num_computed - window + 1) // bs
            first_unquiet = min(first_unquiet, (first_needed + 1) * bs + window - 1)
        return first_unquiet, num_table_blocks * bs

    def _allocate(
        self,
        req: Request,
        tables: list[list[Block]],
        num_new_tokens: int,
        hit: PrefixHit,
        cache_salt: str | None,
    ) -> list[list[int]] | None:
        """allocate_slots' allocation, after a running request's window release."""
        num_computed = req.num_computed_tokens + hit.num_blocks * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_alloc = [
            max(num_needed - len(table) - len(hit.blocks[g]), 0) for g, table in enumerate(tables)
        ]
        # Cached blocks that sit in the free queue count against the free total when taken.
        held = hit.held()
        num_evictable_hits = sum(1 for b in held if b.ref_cnt == 0)
        if sum(num_alloc) + num_evictable_hits > self.pool.num_free_blocks:
            if not any(tables):
                del self._req_blocks[req.req_id]
            return None
        self.pool.touch(held)
        new_ids = []
        for g, table in enumerate(tables):
            new = hit.blocks[g] + self.pool.allocate(num_alloc[g])
            table.extend(new)
            new_ids.append([b.block_id for b in new])
        self._cache_full_blocks(req, num_computed + num_new_tokens, cache_salt)
        return new_ids

    def _grow(
        self, req: Request, tables: list[list[Block]], num_tokens: int, cache_salt: str | None
    ) -> list[list[int]] | None:
        """A running request's allocation: each table to ``num_tokens`` tokens' blocks (the
        case of ``_allocate`` without a prefix hit: every table is as long as the others)."""
        num_new = -(-num_tokens // self.block_size) - len(tables[0])
        if num_new * len(tables) > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(num_new * len(tables))  # one call: rarely over one a group
        new_ids = []
        for g, table in enumerate(tables):
            new = blocks[g * num_new : (g + 1) * num_new]
            table += new
            new_ids.append([b.block_id for b in new])
        self._cache_full_blocks(req, num_tokens, cache_salt)
        return new_ids

    def _no_hit(self) -> PrefixHit:
        return PrefixHit(0, [[] for _ in self.group_windows])

    def free(self, req: Request, cache_salt: str | None = None) -> None:
        """Release all the request's blocks (each table tail first: see block_pool), its full
        computed ones findable by their hashes (``cache_salt``: the request's, as it was
        allocated with)."""
        if req.req_id in self._req_blocks:
            self._cache_full_blocks(req, req.num_computed_tokens, cache_salt)
        tables = self._req_blocks.pop(req.req_id, [])
        self._quiet.pop(req.req_id, None)
        self._req_hashes.pop(req.req_id, None)
        self._num_hashed.pop(req.req_id, None)
        for table in tables:
            self.pool.free(b for b in reversed(table) if b.block_id != NULL_BLOCK)

    def _first_needed(self, group: int, num_computed_blocks: int) -> int:
        """The first block of a group that a query at the start of block ``num_computed_blocks``
        sees: 0 for full attention, the block of its window's first key otherwise."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, num_computed_blocks * self.block_size - window + 1) // self.block_size

    def _release_behind_windows(self, tables: list[list[Block]], num_computed: int) -> None:
        """Release what fell behind each window group's window since the last step."""
        for window, groups in self._windows:
            # Groups of one window release in lockstep (their null prefixes are equal): the
            # first says whether a block fell out of the window since the last step.
            first_needed = max(0, num_computed - window + 1) // self.block_size
            table = tables[groups[0]]
            if 0 < first_needed <= len(table) and table[first_needed - 1].block_id:
                self._release_before(first_needed, [tables[g] for g in groups])

    def _release_before(self, first_needed: int, tables: list[list[Block]]) -> None:
        """Release the blocks before block ``first_needed`` of window groups' tables (those
        wholly before the window of the next query): back to the pool, the null block in their
        entries."""
        null = self.pool.blocks[NULL_BLOCK]
        freed: list[Block] = []
        for table in tables:
            # The null entries are a prefix of the table (a prefix hit's, then each release's),
            # so the blocks to free are those just before first_needed back to the first null
            # one: O(1) on a step that releases little, not a walk over the whole context.
            end = i = min(first_needed, len(table))
            while i > 0 and table[i - 1].block_id != NULL_BLOCK:
                i -= 1
            freed += table[i:end]  # freed in table order
            table[i:end] = [null] * (end - i)
        self.pool.free(freed)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, req: Request, num_tokens: int, cache_salt: str | None) -> None:
        """Register the request's newly full blocks under their hashes, in every group (a
        block another request registered first stays unregistered: first writer wins)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self._num_hashed.get(req.req_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(req, num_full, cache_salt)
        tables = self._req_blocks[req.req_id]
        bs, suffixes, cache_block = self.block_size, self._group_suffixes, self.pool.cache_block
        for i in range(start, num_full):
            chunk = None  # the block's tokens, sliced once for every group that registers it
            for table, suffix in zip(tables, suffixes):
                block = table[i]
                if block.block_hash is None and block.block_id != NULL_BLOCK:
                    chunk = chunk or tuple(req.token_range(i * bs, (i + 1) * bs))
                    cache_block(block, hashes[i] + suffix, chunk)  # _group_key's
        self._num_hashed[req.req_id] = num_full

    def _hashes(self, req: Request, num_full: int, cache_salt: str | None) -> list[BlockHash]:
        """Chained hashes of the first ``num_full`` blocks, memoized per request."""
        hashes = self._req_hashes.setdefault(req.req_id, [])
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            chunk = req.token_range(i * bs, (i + 1) * bs)
            hashes.append(hash_block_tokens(parent, chunk, cache_salt if i == 0 else None))
        return hashes


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """A block's key in the pool's index: the same tokens hold other layers in each group."""
    return block_hash + group.to_bytes(2, "little")
