"""Recording C kernel calls: every call goes through ``launch``, which also appends it to the
active ``Recording``, if any. A decode step run inside ``recording()`` becomes a
``graph.Graph`` that replays all its kernel calls in one C call (worker/decode_graph.py).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from tokenmill.kernels import abi

# Op kinds and row width of a recorded call (csrc/tokenmill.h: enum tm_op, TM_OP_WIDTH).
_OPS = abi.enum("tm_op")
OP_QGEMM = _OPS["TM_OP_QGEMM"]
OP_RMSNORM = _OPS["TM_OP_RMSNORM"]
OP_ROPE = _OPS["TM_OP_ROPE"]
OP_ATTN = _OPS["TM_OP_ATTN"]
OP_EMBED = _OPS["TM_OP_EMBED"]
OP_ACT_MUL = _OPS["TM_OP_ACT_MUL"]
OP_KV_WRITE = _OPS["TM_OP_KV_WRITE"]
OP_ADD = _OPS["TM_OP_ADD"]
OP_GATHER = _OPS["TM_OP_GATHER"]
OP_KV_WRITE_Q8 = _OPS["TM_OP_KV_WRITE_Q8"]
OP_MOE_ROUTE = _OPS["TM_OP_MOE_ROUTE"]
OP_MOE_EXPERTS = _OPS["TM_OP_MOE_EXPERTS"]
OP_HALF_GEMM = _OPS["TM_OP_HALF_GEMM"]
OP_HALF_ROWS = _OPS["TM_OP_HALF_ROWS"]
OP_WIDTH = abi.define("TM_OP_WIDTH")
OP_NAMES = {
    OP_QGEMM: "matmul",
    OP_RMSNORM: "rmsnorm",
    OP_ROPE: "rope",
    OP_ATTN: "attention",
    OP_EMBED: "embedding",
    OP_ACT_MUL: "act*mul",
    OP_KV_WRITE: "kv write",
    OP_ADD: "add",
    OP_GATHER: "embedding (float)",
    OP_KV_WRITE_Q8: "kv write (int8/fp8)",
    OP_MOE_ROUTE: "moe route",
    OP_MOE_EXPERTS: "moe experts",
    OP_HALF_GEMM: "matmul (f16/bf16)",
    OP_HALF_ROWS: "embedding (f16/bf16)",
}


class Recording:
    """Kernel calls made while ``recording()`` is active, with the tensors they touched (kept
    alive, so the addresses a replay uses stay valid)."""

    def __init__(self) -> None:
        self.ops: list[list[int]] = []
        self.tensor_args: list[tuple[int, int, torch.Tensor]] = []  # (call, column, tensor)

    def add(self, op: int, args: tuple[Any, ...]) -> None:
        row = [op]
        for a in args:
            if isinstance(a, torch.Tensor):
                self.tensor_args.append((len(self.ops), len(row), a))
                row.append(a.data_ptr())
            elif a is None:
                row.append(0)
            elif isinstance(a, float):  # a double's bits; graph.c narrows to float
                row.append(struct.unpack("<q", struct.pack("<d", a))[0])
            else:
                row.append(int(a))
        self.ops.append(row + [0] * (OP_WIDTH - len(row)))


# The recording of the decode step being captured, if any. A context variable, not a module
# global: set only inside ``recording()`` and private to the thread that captures.
_RECORDING: ContextVar[Recording | None] = ContextVar("tokenmill_recording", default=None)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Run kernels as usual and also record every call (see ``graph.Graph``)."""
    rec = Recording()
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)


def launch(op: int, fn: Any, *args: Any) -> Any:
    """fn(*args) with tensors passed as pointers; recorded when a recording is active."""
    rc = fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
    rec = _RECORDING.get()
    if rec is not None:
        rec.add(op, args)
    return rc
