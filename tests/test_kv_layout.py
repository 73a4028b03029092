"""KV layouts: which layers share a block, and what a request holds (no torch)."""

from __future__ import annotations

from tokenmill.kv_layout import kv_tensors, plan_kv_layout, uniform_layout


def gemma3_windows(num_layers: int, window: int = 512) -> list[int | None]:
    """Gemma 3's pattern: every sixth layer global, the others local."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_270m_cuts_its_layers_into_groups_of_its_three_global_ones():
    layout = plan_kv_layout(gemma3_windows(18), max_model_len=8192)
    assert layout.group_size == 3
    assert layout.group_windows == (None, 512, 512, 512, 512, 512)
    assert [i for i, g in enumerate(layout.layer_groups) if g == 0] == [5, 11, 17]
    assert [i for i, g in enumerate(layout.layer_groups) if g == 1] == [0, 1, 2]
    assert [i for i, g in enumerate(layout.layer_groups) if g == 5] == [14, 15, 16]
    # Every (group, tensor) place holds one layer: no two layers write the same memory.
    places = set(zip(layout.layer_groups, layout.layer_tensors))
    assert len(places) == 18 and {t for _, t in places} == {0, 1, 2}


def test_a_kind_the_group_size_does_not_divide_leaves_places_unused():
    # Gemma 3 1B: 26 layers, 4 global and 22 local: groups of 4, the last local one half full.
    layout = plan_kv_layout(gemma3_windows(26), max_model_len=32768)
    assert layout.group_size == 4
    assert layout.group_windows == (None,) + (512,) * 6
    assert layout.layer_groups.count(6) == 2
    assert len(set(zip(layout.layer_groups, layout.layer_tensors))) == 26


def test_one_group_when_windows_never_release_or_every_layer_attends_alike():
    # A window as long as the context releases nothing: every layer in one block.
    assert plan_kv_layout(gemma3_windows(18), max_model_len=512) == uniform_layout(18)
    assert plan_kv_layout([None] * 4, max_model_len=4096) == uniform_layout(4)
    assert plan_kv_layout([64] * 4, max_model_len=4096) == uniform_layout(4, window=64)
    # hybrid=False (a draft model's cache): one group whatever the windows.
    assert plan_kv_layout(gemma3_windows(18), 8192, hybrid=False) == uniform_layout(18)


def test_blocks_held_by_a_request():
    full = uniform_layout(18)
    assert full.blocks_held(4096, 16, 2048) == 256
    # A 4,096-token window behind a 2,048-token step: 6,143 tokens over blocks of 16, + 1.
    assert uniform_layout(4, 4096).blocks_held(32768, 16, 2048) == 385
    assert uniform_layout(4, 4096).blocks_held(1024, 16, 2048) == 64  # never the whole context
    # gemma-3-270m at 8,192 tokens: 512 full blocks and 5 x 161 window ones (of 3 layers each)
    # rather than 512 blocks of 18 layers: 3,951 layers' blocks instead of 9,216.
    gemma = plan_kv_layout(gemma3_windows(18), 8192)
    assert gemma.blocks_held(8192, 16, 2048) == 512 + 5 * 161
    assert gemma.blocks_held(8192, 16, 2048) * gemma.group_size == 3951
    # A short request holds the same number of blocks in every group.
    assert gemma.blocks_held(100, 16, 2048) == 6 * 7


def test_max_request_tokens_inverts_blocks_held():
    gemma = plan_kv_layout(gemma3_windows(18), 8192)
    for num_blocks in (6, 100, 1317, 5000):
        tokens = gemma.max_request_tokens(num_blocks, 16, 2048)
        assert gemma.blocks_held(tokens, 16, 2048) <= num_blocks
        assert gemma.blocks_held(tokens + 16, 16, 2048) > num_blocks
    assert gemma.max_request_tokens(1317, 16, 2048) == 8192
    assert uniform_layout(18).max_request_tokens(100, 16, 2048) == 1600


def test_kv_tensors_share_one_tensor_between_gemma4_shapes():
    """Gemma 4's global layers (1 KV head of 32) beside window layers (2 of 16, or 1 of 16):
    rows as long share a tensor in their own shapes; shorter rows are viewed as repeated heads
    of their width; a quantized cache keeps a tensor per shape."""
    layout = plan_kv_layout([24, 24, None, 24, 24, None], max_model_len=256)
    same_row = [(2, 16), (2, 16), (1, 32), (2, 16), (2, 16), (1, 32)]
    shapes, _, views = kv_tensors(layout, same_row, num_heads=4)
    assert len(shapes) == layout.group_size == 2 and views == tuple(same_row)
    shorter = [(1, 16), (1, 16), (1, 32), (1, 16), (1, 16), (1, 32)]
    shapes, _, views = kv_tensors(layout, shorter, num_heads=4)
    assert shapes == ((1, 32), (1, 32)) and views[0] == (2, 16) and views[2] == (1, 32)
    shapes, _, views = kv_tensors(layout, shorter, num_heads=4, exact=True)
    assert len(shapes) == 4 and views == tuple(shorter)
