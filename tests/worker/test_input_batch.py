"""The worker's per-request block tables (worker/input_batch.py: BlockTables)."""

from __future__ import annotations

import numpy as np

from tokenmill.worker.input_batch import BlockTables


def test_block_tables_hold_each_group_and_grow_as_blocks_arrive() -> None:
    tables = BlockTables([[3, 4], [7]])
    assert tables.num_groups == 2
    assert tables.group(0).tolist() == [3, 4]
    assert tables.group(1).tolist() == [7]
    # Past its initial width (16) the array grows; earlier entries stay.
    tables.extend(1, list(range(100, 140)))
    tables.extend(0, [])
    assert tables.group(1).tolist() == [7, *range(100, 140)]
    assert tables.group(0).tolist() == [3, 4]


def test_columns_pad_every_group_with_the_null_block() -> None:
    tables = BlockTables([[3, 4, 5], [9]])
    np.testing.assert_array_equal(tables.columns(4), [[3, 4, 5, 0], [9, 0, 0, 0]])
    # Wider than the array: it grows, zeros past each table's end.
    wide = tables.columns(40)
    assert wide.shape == (2, 40)
    assert wide[0, :3].tolist() == [3, 4, 5] and not wide[0, 3:].any() and not wide[1, 1:].any()
    tables.extend(1, [8])
    assert tables.columns(2).tolist() == [[3, 4], [9, 8]]
