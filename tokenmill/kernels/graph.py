"""Recorded kernel calls replayed by one C call (``Graph``), and the scratch memory that the
intermediates of several graphs share (``Scratch``)."""

from __future__ import annotations

import torch

from tokenmill.kernels.cpu_library import library
from tokenmill.kernels.recording import OP_NAMES, OP_QGEMM, Recording


class Scratch:
    """Memory the intermediates of several graphs share: only one graph runs at a time, and a
    step's intermediates live only within its replay. Grows to the largest graph's need."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.buffer.numel():
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # graphs re-point on replay


_SCRATCH_ALIGN = 64


def plan_scratch(rec: Recording, allocated: set[int]) -> tuple[dict[int, int], int]:
    """Offsets in a scratch buffer for the recorded storages whose base address is in
    ``allocated`` (made during the recording: the step's intermediates), and the bytes needed.
    A storage lives from the first call that touches it to the last; storages whose lives do
    not overlap share bytes (first fit, in order of first use)."""
    lives: dict[int, list[int]] = {}  # base -> [first call, last call, nbytes]
    for call, _, t in rec.tensor_args:
        storage = t.untyped_storage()
        base = storage.data_ptr()
        if base not in allocated or storage.nbytes() == 0:
            continue
        life = lives.setdefault(base, [call, call, storage.nbytes()])
        life[1] = call
    offsets: dict[int, int] = {}
    placed: list[tuple[int, int, int]] = []  # (offset, end offset, last call), by offset
    total = 0
    for base, (first, last, nbytes) in sorted(lives.items(), key=lambda kv: kv[1][0]):
        placed = [p for p in placed if p[2] >= first]  # those still live at this call
        size = -(-nbytes // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        offset = 0
        for start, end, _ in sorted(placed):
            if start - offset >= size:
                break
            offset = max(offset, end)
        offsets[base] = offset
        placed.append((offset, offset + size, last))
        total = max(total, offset + size)
    return offsets, total


class Graph:
    """Recorded kernel calls, replayed in order by one C call. What they read and write is
    fixed: a replay sees new inputs only through the buffers the recorded calls used.

    Given ``scratch`` and the base addresses of the storages ``allocated`` during the
    recording, those intermediates move into the shared scratch buffer (and the recording's
    own copies are let go): each graph would otherwise hold every intermediate of its step,
    ~0.8 MB per batch row for gemma-3-270m, ~0.5 GB for 32 batch sizes."""

    def __init__(
        self, rec: Recording, scratch: Scratch | None = None, allocated: set[int] | None = None
    ) -> None:
        lib = library()
        if lib is None:
            raise ValueError("graphs replay C kernels, which are not built or not supported here")
        self.ops = torch.tensor(rec.ops, dtype=torch.int64)
        self._run = lib.tm_graph_run
        self._scratch = scratch
        self._scratch_ptr = -1  # the scratch address the ops point into
        offsets, nbytes = plan_scratch(rec, allocated or set()) if scratch else ({}, 0)
        rows, cols, rel = [], [], []
        for call, col, t in rec.tensor_args:
            base = t.untyped_storage().data_ptr()
            if base in offsets:
                rows.append(call)
                cols.append(col)
                rel.append(offsets[base] + t.data_ptr() - base)
        self._moved = (torch.tensor(rows), torch.tensor(cols), torch.tensor(rel))
        self._tensors = [  # what the calls still point into: kept alive
            t for _, _, t in rec.tensor_args if t.untyped_storage().data_ptr() not in offsets
        ]
        if scratch is not None:
            scratch.reserve(nbytes)

    def __len__(self) -> int:
        return self.ops.shape[0]

    def replay(self, times: torch.Tensor | None = None) -> None:
        """Run the recorded calls; ``times`` (float64 [len(self)]), if given, gets each call's
        wall time in seconds (benchmarks/decode_breakdown.py)."""
        if self._scratch is not None and self._scratch_ptr != self._scratch.buffer.data_ptr():
            self._scratch_ptr = self._scratch.buffer.data_ptr()
            rows, cols, rel = self._moved
            self.ops[rows, cols] = rel + self._scratch_ptr
        ptr = None if times is None else times.data_ptr()
        if self._run(self.ops.data_ptr(), self.ops.shape[0], ptr) != 0:
            raise MemoryError("a replayed kernel could not allocate its scratch buffer")

    def op_names(self) -> list[str]:
        """What each recorded call is: its kernel, and for a matmul its output size."""
        return [
            f"matmul N={int(row[2])}" if row[0] == OP_QGEMM else OP_NAMES[int(row[0])]
            for row in self.ops.tolist()
        ]
