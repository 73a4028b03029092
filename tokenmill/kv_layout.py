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

Gemma 4's global layers have other K/V shapes (head_dim, KV heads) than its window layers, so
one tensor serves both as ``kv_tensors`` plans it: its token rows are the longest layer's
(heads x head_dim); a layer of shorter rows views them as more heads of its own width and
stores each of its KV heads repeated (e.g. 1 x 512 rows hold a window layer's 1 x 256 as 2 x
256, two copies). So a block holds max, not sum, of the shapes' bytes; the shorter layers'
attention reads their copies too. A quantized cache (per-head scales) gets a tensor per
shape. Layers that hold no K/V of their own (Gemma 4's KV-sharing layers, Qwen3-Next's
linear-attention ones) are not in the layout at all (``ModelConfig.kv_layers``).
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


def kv_tensors(
    layout: KVLayout,
    layer_shapes: Sequence[tuple[int, int]],
    num_heads: int,
    exact: bool = False,
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """The cache's tensors for layers of shapes ``layer_shapes`` ((KV heads, head_dim) per
    layer, ``num_heads`` query heads): each tensor's shape, per layer the tensor it uses, and
    the shape the layer views it in. Every layer holding the layout's tensor j shares one tensor
    with the longest token row (heads x head_dim) among them: a layer with rows as long views
    it in its own shape; one with shorter rows views them as more heads of its width and stores
    each of its KV heads repeated (``Attention``; attention is the same, the query heads of a
    group reading one head's copies). A layer that cannot (its width does not divide the row,
    or the repeated heads do not group the query heads) gets a tensor of its own; so does every
    shape when ``exact`` (a quantized cache: its scales are per head)."""
    rows: dict[int, tuple[int, int]] = {}  # j -> the shape of its longest row
    for layer, j in enumerate(layout.layer_tensors):
        heads, head_dim = layer_shapes[layer]
        if j not in rows or heads * head_dim > rows[j][0] * rows[j][1]:
            rows[j] = (heads, head_dim)
    tensors: dict[tuple[int, object], int] = {}
    shapes: list[tuple[int, int]] = []
    layer_tensor, layer_view = [], []
    for layer, j in enumerate(layout.layer_tensors):
        heads, head_dim = layer_shapes[layer]
        row = rows[j][0] * rows[j][1]
        view_heads = row // head_dim
        shareable = (
            not exact
            and row % head_dim == 0
            and view_heads % heads == 0
            and num_heads % view_heads == 0
        )
        key, shape = (
            ((j, row), (view_heads, head_dim))
            if shareable
            else ((j, (heads, head_dim)), (heads, head_dim))
        )
        if key not in tensors:
            tensors[key] = len(shapes)
            shapes.append(rows[j] if shareable else shape)
        layer_tensor.append(tensors[key])
        layer_view.append(shape)
    return tuple(shapes), tuple(layer_tensor), tuple(layer_view)
