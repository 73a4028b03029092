"""tokenmill's C kernels (tokenmill/csrc), loaded through ctypes.

qgemm.c: the packed-weight matmul; decode_ops.c: RMSNorm, RoPE and paged decode attention;
graph.c: embedding rows, act(gate) * up, K/V cache writes, and the replay of recorded calls;
all on float32 CPU tensors. The extension is built by ``pip install`` where a C compiler exists;
it needs AVX2 and FMA at run time. ``available()`` says whether it can be used; every caller
has a pure-torch path it takes otherwise (and that tests compare against), so everything runs
everywhere. Callers check shapes and dtypes (``fits``) before calling.

Every call goes through ``_launch``, which also appends it to the active ``Recording``, if
any: a decode step run inside ``recording()`` becomes a ``Graph`` that replays all its kernel
calls in one C call (tokenmill/worker/decode_graph.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import struct
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

from tokenmill.quant.packed import PackedWeight

logger = logging.getLogger(__name__)

_KINDS = {"q8": 0, "q4": 1, "u8": 4}
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# tm_qgemm(M, N, K, x, kind, codes, scales, offsets, G, bias, y, act_int8)
QGEMM_ARGTYPES = [_i64, _i64, _i64, _ptr, _int, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _int]
# Op kinds and row width of a recorded call (tokenmill/csrc/graph.c).
(
    _OP_QGEMM,
    _OP_RMSNORM,
    _OP_ROPE,
    _OP_ATTN,
    _OP_EMBED,
    _OP_ACT_MUL,
    _OP_KV_WRITE,
    _OP_ADD,
    _OP_GATHER,
    _OP_KV_WRITE_Q8,
) = range(1, 11)
_OP_WIDTH = 20
_OP_NAMES = {
    _OP_QGEMM: "matmul",
    _OP_RMSNORM: "rmsnorm",
    _OP_ROPE: "rope",
    _OP_ATTN: "attention",
    _OP_EMBED: "embedding",
    _OP_ACT_MUL: "act*mul",
    _OP_KV_WRITE: "kv write",
    _OP_ADD: "add",
    _OP_GATHER: "embedding (float)",
    _OP_KV_WRITE_Q8: "kv write (int8/fp8)",
}
ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}  # what act_mul computes
MAX_ATTENTION_GROUP = 16  # query heads per KV head decode_attention takes (TM_MAX_GROUP)


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        from tokenmill import _qgemm
    except ImportError:
        logger.info("packed-weight kernel not built; using the torch reference")
        return None
    lib = ctypes.CDLL(_qgemm.__file__)
    if not lib.tm_cpu_supported():
        logger.info("CPU lacks AVX2/FMA; packed weights use the torch reference")
        return None
    lib.tm_qgemm.argtypes = QGEMM_ARGTYPES
    lib.tm_qgemm.restype = _int
    lib.tm_dequant_rows.argtypes = [_i64, _i64, _i64, _int, _ptr, _ptr, _ptr, _i64, _ptr]
    lib.tm_dequant_rows.restype = None
    lib.tm_rmsnorm.argtypes = [
        _ptr,
        _i64,
        _i64,
        _ptr,
        ctypes.c_float,
        _ptr,
        _ptr,
        _i64,
        _i64,
        ctypes.c_float,
    ]
    lib.tm_rmsnorm.restype = None
    lib.tm_rope_neox.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    lib.tm_rope_neox.restype = None
    lib.tm_decode_attn.argtypes = (
        [_ptr, _i64] + [_ptr] * 7 + [_i64] * 7 + [ctypes.c_float, _ptr, _int]
    )
    lib.tm_decode_attn.restype = _int
    lib.tm_embed_rows.argtypes = [
        _ptr,
        _i64,
        _i64,
        _int,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        ctypes.c_float,
        _ptr,
    ]
    lib.tm_embed_rows.restype = None
    lib.tm_act_mul.argtypes = [_ptr, _i64, _i64, _i64, _int, _ptr]
    lib.tm_act_mul.restype = None
    lib.tm_kv_write.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _int]
    lib.tm_kv_write.restype = None
    lib.tm_gather_rows.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_float, _ptr]
    lib.tm_gather_rows.restype = None
    lib.tm_kv_write_q8.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _int]
    lib.tm_kv_write_q8.argtypes += [_ptr] * 4
    lib.tm_kv_write_q8.restype = None
    lib.tm_add.argtypes = [_ptr, _ptr, _ptr, _i64]
    lib.tm_add.restype = None
    lib.tm_argmax_rows.argtypes = [_ptr, _i64, _i64, _ptr]
    lib.tm_argmax_rows.restype = _int
    lib.tm_graph_run.argtypes = [_ptr, _i64, _ptr]
    lib.tm_graph_run.restype = _int
    _fp8_table()  # built now: a decode step being recorded must not compute it
    return lib


def available() -> bool:
    return _library() is not None


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
        self.ops.append(row + [0] * (_OP_WIDTH - len(row)))


# The recording of the decode step being captured, if any. A context variable, not a module
# global: set only inside ``recording()`` and private to the thread that captures.
_RECORDING: ContextVar[Recording | None] = ContextVar("tokenmill_recording", default=None)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Run kernels as usual and also record every call (see ``Graph``)."""
    rec = Recording()
    token = _RECORDING.set(rec)
    try:
        yield rec
    finally:
        _RECORDING.reset(token)


class Scratch:
    """Memory the intermediates of several graphs share: only one graph runs at a time, and a
    step's intermediates live only within its replay. Grows to the largest graph's need."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.buffer.numel():
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)  # graphs re-point on replay


_SCRATCH_ALIGN = 64


def _plan_scratch(rec: Recording, allocated: set[int]) -> tuple[dict[int, int], int]:
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
        self.ops = torch.tensor(rec.ops, dtype=torch.int64)
        self._run = _library().tm_graph_run
        self._scratch = scratch
        self._scratch_ptr = -1  # the scratch address the ops point into
        offsets, nbytes = _plan_scratch(rec, allocated or set()) if scratch else ({}, 0)
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
            f"matmul N={int(row[2])}" if row[0] == _OP_QGEMM else _OP_NAMES[int(row[0])]
            for row in self.ops.tolist()
        ]


def _launch(op: int, fn: Any, *args: Any) -> Any:
    """fn(*args) with tensors passed as pointers; recorded when a recording is active."""
    rc = fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])
    rec = _RECORDING.get()
    if rec is not None:
        rec.add(op, args)
    return rc


def supports(w: PackedWeight) -> bool:
    """Whether the kernel handles this weight's layout (else the torch reference runs)."""
    n, k = w.shape
    chunks = w.group // 32  # the kernel needs G = 16 or 32 · 2^j
    group_ok = w.group == 16 or (w.group % 32 == 0 and chunks & (chunks - 1) == 0)
    # float16 scales come from Q8_0 / Q5_0 / Q4_0 only: 32-element groups; 16-element groups
    # from Q6_K only (byte codes, "u8").
    scales_ok = w.scales.dtype == torch.float32 or (
        w.scales.dtype == torch.float16 and w.group % 32 == 0
    )
    # rows of a multiple of 64 elements: codes in the kernel's lane order (quant/packed.py)
    return (
        k % w.group == 0
        and k % 64 == 0
        and group_ok
        and scales_ok
        and not (w.kind == "q4" and w.group == 16)
        and w.codes.device.type == "cpu"
    )


def kind_code(w: PackedWeight) -> int:
    """The kernels' ``kind``: bit 0 for 4-bit codes, bit 2 for "u8" bytes (their zero point in
    bits 8-15), bit 1 for float16 scales."""
    return _KINDS[w.kind] | (2 if w.scales.dtype == torch.float16 else 0) | w.zero << 8


def qgemm(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None,
    act_int8: bool,
    out: torch.Tensor | None = None,
    q8_unsigned: bool = False,
) -> torch.Tensor:
    """y[M, N] = x[M, K] · Wᵀ (+ bias) in float32 with the C kernel (callers check available),
    into ``out`` when given (float32, contiguous, [M, N]). ``q8_unsigned`` (with int8
    activations): "q8" codes run as unsigned bytes against 7-bit activations, faster
    (packed.activation_levels)."""
    lib = _library()
    assert lib is not None  # callers checked available() and supports(w)
    x = x.float().contiguous()
    m, k = x.shape
    y = out if out is not None else torch.empty(m, w.shape[0], dtype=torch.float32)
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32 and y.is_contiguous()
    rc = _launch(
        _OP_QGEMM,
        lib.tm_qgemm,
        m,
        w.shape[0],
        k,
        x,
        kind_code(w),
        w.codes,
        w.scales,
        w.offsets,
        w.group,
        bias,
        y,
        (2 if q8_unsigned else 1) if act_int8 else 0,
    )
    if rc != 0:
        raise MemoryError("packed matmul could not allocate its activation buffer")
    return y


def dequantize_rows(w: PackedWeight, start: int, end: int) -> torch.Tensor:
    """Float32 rows [start, end) of W with the C kernel (a tile for a float GEMM)."""
    lib = _library()
    assert lib is not None  # callers checked available() and supports(w)
    out = torch.empty(end - start, w.shape[1], dtype=torch.float32)
    lib.tm_dequant_rows(
        start,
        end,
        w.shape[1],
        kind_code(w),
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        None if w.offsets is None else w.offsets.data_ptr(),
        w.group,
        out.data_ptr(),
    )
    return out


def fits(*tensors: torch.Tensor) -> bool:
    """Float32, contiguous CPU tensors, with the kernels built: the decode ops may run."""
    return available() and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_offset: float,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + x / rms(x) · (weight + weight_offset) over the last dim (a multiple of 8).
    x is dense, or [tokens, heads, dim] with dense heads (``heads_fit``); out is dense."""
    lib = _library()
    assert lib is not None
    out = torch.empty(x.shape, dtype=torch.float32)
    dim = x.shape[-1]
    inner, outer_stride = (x.shape[1], x.stride(0)) if not x.is_contiguous() else (1, dim)
    _launch(
        _OP_RMSNORM,
        lib.tm_rmsnorm,
        x,
        outer_stride,
        inner,
        weight,
        float(weight_offset),
        residual,
        out,
        x.numel() // dim,
        dim,
        float(eps),
    )
    return out


def heads_fit(x: torch.Tensor) -> bool:
    """Whether ``rmsnorm``, ``rope_neox_`` and ``decode_attention`` read x: float32 CPU, dense,
    or [tokens, heads, dim] with each token's heads dense (q or k viewed in a fused q/k/v
    projection's output)."""
    if x.is_contiguous():
        return fits(x)
    heads_dense = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    return heads_dense and available() and x.dtype == torch.float32 and x.device.type == "cpu"


def rope_neox_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_dim] (``heads_fit``) in place; positions int64
    [tokens]."""
    lib = _library()
    assert lib is not None
    tokens, heads, dim = x.shape
    _launch(_OP_ROPE, lib.tm_rope_neox, x, x.stride(0), positions, cos, sin, tokens, heads, dim)
    return x


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per sequence (q [nd, heads, head_dim], ``heads_fit``) against its paged K/V
    (float32 or float16, or int8 / fp8 e4m3 with per-token-per-head scales); int64 tables."""
    lib = _library()
    assert lib is not None
    nd, heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    rc = _launch(
        _OP_ATTN,
        lib.tm_decode_attn,
        q,
        q.stride(0),
        k_cache,
        v_cache,
        None if kv_scales is None else kv_scales[0],
        None if kv_scales is None else kv_scales[1],
        _fp8_table() if k_cache.dtype == torch.float8_e4m3fn else None,
        block_table,
        seq_lens,
        nd,
        heads,
        kv_heads,
        dim,
        bs,
        block_table.shape[1],
        window or 0,
        float(scale),
        out,
        int(k_cache.dtype == torch.float16),
    )
    if rc != 0:
        raise MemoryError("decode attention could not allocate its score buffer")
    return out


@functools.cache
def _fp8_table() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 bytes (the kernel decodes fp8 through it)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def embed_rows(w: PackedWeight, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Float32 rows ``ids`` (int64, contiguous) of a packed table, times ``scale``."""
    lib = _library()
    assert lib is not None  # callers checked available() and supports(w)
    out = torch.empty(ids.numel(), w.shape[1], dtype=torch.float32)
    _launch(
        _OP_EMBED,
        lib.tm_embed_rows,
        ids,
        ids.numel(),
        w.shape[1],
        kind_code(w),
        w.codes,
        w.scales,
        w.offsets,
        w.group,
        float(scale),
        out,
    )
    return out.reshape(*ids.shape, w.shape[1])


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up [tokens, 2d] = [gate | up] (d a multiple of 8)."""
    lib = _library()
    assert lib is not None
    n, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, d, dtype=torch.float32)
    _launch(_OP_ACT_MUL, lib.tm_act_mul, gate_up, n, d, 2 * d, ACTIVATIONS[act], out)
    return out


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """k, v [tokens, kv_heads, head_dim] (each token's row dense; views into a fused q/k/v
    projection are) into caches [blocks, block_size, kv_heads, head_dim] at their slots: float32
    or float16 (rounded to nearest even), or int8 / fp8 e4m3fn with a float32 scale per token
    per KV head (``scales``), quantized as attention/kv_cache.py's ``write_kv`` does (the same
    bytes)."""
    lib = _library()
    assert lib is not None
    if scales is None:
        _launch(
            _OP_KV_WRITE,
            lib.tm_kv_write,
            k,
            k.stride(0),
            v,
            v.stride(0),
            slot_mapping,
            k.shape[0],
            k.shape[1] * k.shape[2],
            *caches,
            int(caches[0].dtype == torch.float16),
        )
        return
    _launch(
        _OP_KV_WRITE_Q8,
        lib.tm_kv_write_q8,
        k,
        k.stride(0),
        v,
        v.stride(0),
        slot_mapping,
        k.shape[0],
        k.shape[1],
        k.shape[2],
        int(caches[0].dtype == torch.float8_e4m3fn),
        *caches,
        *scales,
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of a float32 [rows, n] tensor (first index among ties); None when
    a row holds a NaN (torch then decides)."""
    lib = _library()
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.tm_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()) != 0:
        return None
    return out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for two dense float32 tensors of one shape (the residual stream's add)."""
    lib = _library()
    assert lib is not None
    out = torch.empty(a.shape, dtype=torch.float32)
    _launch(_OP_ADD, lib.tm_add, a, b, out, a.numel())
    return out


def gather_rows(table: torch.Tensor, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rows ``ids`` (int64, contiguous) of a dense float32 table [vocab, dim], times ``scale``."""
    lib = _library()
    assert lib is not None
    out = torch.empty(ids.numel(), table.shape[1], dtype=torch.float32)
    _launch(
        _OP_GATHER, lib.tm_gather_rows, ids, ids.numel(), table.shape[1], table, float(scale), out
    )
    return out.reshape(*ids.shape, table.shape[1])
