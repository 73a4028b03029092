"""The worker's per-request block tables (worker/input_batch.py: BlockTables) and a decode
step's rows of them (RowTables)."""

from __future__ import annotations

import numpy as np

from tokenmill.worker.input_batch import BlockTables, RowTables


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


def test_row_tables_pad_every_group_with_the_null_block() -> None:
    a, b = BlockTables([[3, 4, 5], [9]]), BlockTables([[1], [2]])
    rows = RowTables(2)
    np.testing.assert_array_equal(rows.take([a, b], 4), [[[3, 4, 5, 0], [1, 0, 0, 0]],
                                                         [[9, 0, 0, 0], [2, 0, 0, 0]]])  # fmt: skip
    # Wider than ever: zeros past each table's end.
    wide = rows.take([a], 40)
    assert wide.shape == (2, 1, 40)
    assert wide[0, 0, :3].tolist() == [3, 4, 5] and not wide[0, 0, 3:].any()


def test_row_tables_follow_each_rows_request_from_step_to_step() -> None:
    """Rows are written again only when their request changed or its tables grew; what they
    hold is always what the rows' tables hold now."""
    long = BlockTables([list(range(1, 40)), [7]])
    short = BlockTables([[5], [6]])
    rows = RowTables(2)
    rows.take([long], 40)
    assert rows.take([long, short], 3).tolist() == [[[1, 2, 3], [5, 0, 0]], [[7, 0, 0], [6, 0, 0]]]
    short.extend(0, [8])  # a new block: its row is written again
    assert rows.take([long, short], 3)[:, 1].tolist() == [[5, 8, 0], [6, 0, 0]]
    # Rows change hands: the short tables take the long one's row, past their end all zero.
    full = rows.take([short, long], 40)
    assert full[:, 0].tolist() == [[5, 8] + [0] * 38, [6] + [0] * 39]
    assert full[0, 1, :39].tolist() == list(range(1, 40))
    # The same tables in several rows (a request's verification rows).
    assert rows.take([short, short], 2).tolist() == [[[5, 8], [5, 8]], [[6, 0], [6, 0]]]
