"""KVLayout: which layers' K/V a KV block holds, and how many block tables a request has.

Most models attend alike in every layer, and one block holds the K/V of every layer for its
tokens: one block table per request. Gemma 2 and 3 mix full-attention layers with sliding-window
ones (gemma-3-270m: 3 global layers, 15 local ones with a 512-token window). A window layer needs
only its window's K/V, so its blocks should go back to the pool once the request moves past them,
while the global layers keep all of theirs: the two kinds cannot share a block.

So layers are cut into *groups* of ``group_size`` layers that attend alike, and every group has
its own block table per request (vLLM's KV cache groups). A block holds the K/V of ``group_size``
layers: cache tensor ``j`` (K and V, ``[num_blocks, block_size, kv_heads, head_dim]``) holds the
j-th layer of every group, so blocks are interchangeable between groups and one pool serves
them all. For gemma-3-270m, group_size 3::

    group 0 (full):        layers  5 11 17    table 0 holds a block for every token
    group 1 (window 512):  layers  0  1  2    tables 1..5 hold only the window's blocks
    group 2 (window 512):  layers  3  4  6
    ...
    group 5 (window 512):  layers 14 15 16
                 K/V tensor:        0  1  2

A request of n tokens then holds ceil(n / 16) blocks in the full group and at most
(window + step) / 16 in each window group: 8,192 tokens hold 512 + 5 x 161 blocks of 3 layers
instead of 512 blocks of 18 layers (2.3x less). ``group_size`` is the smaller kind's layer
count, so that kind has one group; a kind whose count it does not divide leaves tensors unused
in its last group (Gemma 3 1B: 4 global and 22 local layers, 2 of 24 local places idle).

A model whose window covers max_model_len, or whose layers all attend alike, has one group of
every layer (``uniform_layout``): one block table, with the window (Mistral) or without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    group_size: int  # layers a block holds: the K/V tensors of the cache
    group_windows: tuple[int | None, ...]  # per group: its layers' window, None: full attention
    layer_groups: tuple[int, ...]  # per layer: its group (the block table it reads and writes)
    layer_tensors: tuple[int, ...]  # per layer: its K/V tensor

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_hybrid(self) -> bool:
        """Whether window groups sit beside full ones (their blocks are released apart)."""
        return self.num_groups > 1

    def blocks_held(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` holds at once over all its groups: a full
        group every token's, a window group the window behind a step's first query plus the
        step (and a block of misalignment), whichever is fewer."""
        whole = -(-num_tokens // block_size)
        total = 0
        for window in self.group_windows:
            if window is None:
                total += whole
            else:
                total += min(whole, -(-(window - 1 + max_step_tokens) // block_size) + 1)
        return total

    def max_request_tokens(self, num_blocks: int, block_size: int, max_step_tokens: int) -> int:
        """The longest request (in whole blocks of tokens) whose blocks fit in ``num_blocks``."""
        lo, hi = 0, num_blocks  # in blocks of tokens; a request of hi blocks holds >= hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_held(mid * block_size, block_size, max_step_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size

    def describe(self) -> str:
        """One line for the startup log."""
        if not self.is_hybrid:
            window = self.group_windows[0]
            kind = f"every layer within {window} tokens" if window else "every layer"
            return f"a block holds {self.group_size} layers ({kind}), one block table a request"
        kinds = {}
        for window in self.group_windows:
            kinds[window] = kinds.get(window, 0) + 1
        parts = [
            f"{n} of {'full attention' if w is None else f'window {w}'}" for w, n in kinds.items()
        ]
        return (
            f"a block holds {self.group_size} layers; {self.num_groups} block tables a request "
            f"({', '.join(parts)}): window groups keep only their window's blocks"
        )


def uniform_layout(num_layers: int, window: int | None = None) -> KVLayout:
    """One group of every layer: a block holds all layers' K/V."""
    return KVLayout(num_layers, (window,), (0,) * num_layers, tuple(range(num_layers)))


def plan_kv_layout(
    layer_windows: Sequence[int | None], max_model_len: int, hybrid: bool = True
) -> KVLayout:
    """The layout of a model whose layer i attends within ``layer_windows[i]`` tokens (None:
    every token). Windows as long as max_model_len never release a block: they count as full.
    ``hybrid=False`` keeps one group (the window is then only a mask for the window layers)."""
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows]
    kinds = list(dict.fromkeys(windows))  # in order of first appearance
    if len(kinds) == 1:
        return uniform_layout(len(windows), kinds[0])
    if not hybrid:
        return uniform_layout(len(windows))
    # Full attention first: group 0 is the one every request's whole context is in.
    kinds.sort(key=lambda w: (w is not None, w or 0))
    members = {w: [i for i, lw in enumerate(windows) if lw == w] for w in kinds}
    group_size = min(len(m) for m in members.values())
    group_windows: list[int | None] = []
    layer_groups = [0] * len(windows)
    layer_tensors = [0] * len(windows)
    for w in kinds:
        for j, layer in enumerate(members[w]):
            if j % group_size == 0:
                group_windows.append(w)
            layer_groups[layer] = len(group_windows) - 1
            layer_tensors[layer] = j % group_size
    return KVLayout(group_size, tuple(group_windows), tuple(layer_groups), tuple(layer_tensors))
