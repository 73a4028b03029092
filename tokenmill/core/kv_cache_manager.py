"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Block layout of one request (block_size = 4 here)::

    | computed (cached or run) | scheduled this step | free room |
    [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 .. ..]
      full, hashed   full, hashed  partial: never hashed

Full blocks are hashed (chained, see block_pool) as soon as their tokens are scheduled; the engine
runs steps synchronously, so by the next lookup their KV is written.

Sliding-window layers (Gemma 3's local layers, Mistral): a block holds the K/V of *every* layer
for its tokens, local layers included, and local layers merely mask keys outside their window.
So a cached block serves local and global layers alike, and a prefix hit skips all layers for
those tokens. When *every* layer is windowed (Mistral; ``sliding_window`` set), a block whose
tokens all lie before the window of the request's next query is released: its table entry
becomes the null block 0, which no kernel reads (they read only the window), and the block
goes back to the pool, still findable by its hash until it is handed out again. A request then
holds at most window + step tokens of blocks however long it runs. With full layers among the
windowed ones (Gemma 2 and 3) every block stays: releasing the windowed layers' share needs a
pool per layer group, which is not built.
"""

from __future__ import annotations

from tokenmill.core.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from tokenmill.request import Request

NULL_BLOCK = 0  # block_pool never hands it out; released window blocks' table entries


def max_blocks_held(
    block_size: int, max_model_len: int, max_step_tokens: int, window: int | None
) -> int:
    """The most blocks one request holds at once: its whole context, or with every layer
    windowed the window behind a step's first query plus the step (and one block of
    misalignment), whichever is fewer."""
    whole = -(-max_model_len // block_size)
    if window is None:
        return whole
    return min(whole, -(-(window - 1 + max_step_tokens) // block_size) + 1)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # Prefix-cache counters, in tokens (what /metrics reports).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def find_cached_prefix(self, req: Request, cache_salt: str | None = None) -> list[Block]:
        """The longest chain of cached full blocks that starts the request's tokens.

        At least one token is always left to compute, since the model must run on the last one
        to produce the next token's logits.

        NOTE: a request that wants prompt log-probs takes no hits (as in vLLM): the logits of every
        prompt position are needed, so its whole prompt runs. Its full blocks are still cached
        for others.
        """
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._hashes(req, tokens, max_blocks, cache_salt)
        hits: list[Block] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.get_cached_block(block_hash, tokens[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits

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
        cached_blocks: list[Block] | None = None,
        cache_salt: str | None = None,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if blocks run out.

        ``cached_blocks`` are prefix hits for a request that holds no blocks yet. Returns the ids
        of the newly allocated blocks.
        """
        blocks = self._req_blocks.setdefault(req.req_id, [])
        cached_blocks = cached_blocks or []
        num_computed = req.num_computed_tokens + len(cached_blocks) * self.block_size
        if self.sliding_window is not None:
            self._release_before_window(blocks, num_computed)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_alloc = num_needed - len(blocks) - len(cached_blocks)
        # Cached blocks that sit in the free queue count against the free total when taken.
        num_evictable_hits = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_alloc + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self._req_blocks[req.req_id]
            return None
        self.pool.touch(cached_blocks)
        blocks.extend(cached_blocks)
        new_blocks = self.pool.allocate(max(num_alloc, 0))
        blocks.extend(new_blocks)
        self._cache_full_blocks(req, num_computed + num_new_tokens, cache_salt)
        return [b.block_id for b in cached_blocks + new_blocks]

    def free(self, req: Request) -> None:
        """Release all the request's blocks (tail first: see block_pool)."""
        blocks = self._req_blocks.pop(req.req_id, [])
        self._req_hashes.pop(req.req_id, None)
        self.pool.free(b for b in reversed(blocks) if b.block_id != NULL_BLOCK)

    def _release_before_window(self, blocks: list[Block], num_computed: int) -> None:
        """Release the blocks no query from position ``num_computed`` on can see: those wholly
        before its window, which starts at num_computed - window + 1."""
        first_needed = max(0, num_computed - self.sliding_window + 1) // self.block_size
        out = [i for i in range(min(first_needed, len(blocks))) if blocks[i].block_id != NULL_BLOCK]
        if out:
            self.pool.free(blocks[i] for i in out)
            for i in out:
                blocks[i] = self.pool.blocks[NULL_BLOCK]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, req: Request, num_tokens: int, cache_salt: str | None) -> None:
        if not self.enable_caching:
            return
        tokens = req.all_token_ids
        num_full = min(num_tokens, len(tokens)) // self.block_size
        hashes = self._hashes(req, tokens, num_full, cache_salt)
        blocks = self._req_blocks[req.req_id]
        for i in range(num_full):
            if blocks[i].block_hash is None and blocks[i].block_id != NULL_BLOCK:
                start = i * self.block_size
                self.pool.cache_block(blocks[i], hashes[i], tokens[start : start + self.block_size])

    def _hashes(
        self, req: Request, tokens: list[int], num_full: int, cache_salt: str | None
    ) -> list[BlockHash]:
        """Chained hashes of the first ``num_full`` blocks, memoized per request."""
        hashes = self._req_hashes.setdefault(req.req_id, [])
        while len(hashes) < num_full:
            i = len(hashes)
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, chunk, cache_salt if i == 0 else None))
        return hashes
