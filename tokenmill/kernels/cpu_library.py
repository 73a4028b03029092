"""tokenmill's C kernels (tokenmill/csrc), loaded through ctypes: thin wrappers, one a kernel.

qgemm.c: the packed-weight matmul; decode_ops.c: RMSNorm, RoPE and paged decode attention;
graph.c: embedding rows, act(gate) * up, K/V cache writes, and the replay of recorded calls;
moe.c: a mixture-of-experts router and its routed experts; all on float32 CPU tensors. The
extension is built by ``pip install`` where a C compiler exists; it needs AVX2 and FMA at run
time, and runs the packed matmul's int8 dot products on AVX512-VNNI or AVX-VNNI where the CPU
has it (``isa()``; the results are bit-identical). ``available()`` says whether it can be used.
The wrappers check nothing: the CPU backends (kernels/cpu_backend.py,
attention/backends/cpu_backend.py) call them only on inputs that fit (``is_dense_f32``,
``has_dense_heads``, ``supports``), after checking ``available()`` once, when they are created.

Every call goes through ``recording.launch``, so a decode step's calls can be recorded and
replayed (kernels/graph.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.kernels import abi
from tokenmill.kernels.recording import (
    OP_ACT_MUL,
    OP_ADD,
    OP_ATTN,
    OP_EMBED,
    OP_GATHER,
    OP_HALF_GEMM,
    OP_HALF_ROWS,
    OP_KV_WRITE,
    OP_KV_WRITE_Q8,
    OP_MOE_EXPERTS,
    OP_MOE_ROUTE,
    OP_QGEMM,
    OP_RMSNORM,
    OP_ROPE,
    launch,
)

if TYPE_CHECKING:
    from tokenmill.quant.packed import PackedWeight

logger = logging.getLogger(__name__)

ACTIVATIONS = {  # what act_mul computes: "silu" for TM_ACT_SILU
    name.removeprefix("TM_ACT_").lower(): code for name, code in abi.enum("tm_act").items()
}
MAX_ATTENTION_GROUP = abi.define("TM_MAX_GROUP")  # query heads per KV head decode_attention takes
MOE_MAX_EXPERTS = abi.define("TM_MOE_MAX_EXPERTS")  # experts moe_route takes
# GGUF types relay_gguf re-lays at load: Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS
RELAID_TYPES = (2, 6, 8, 12, 13, 14, 23)
# Q4_0, Q5_0, Q8_0 (csrc/relay.c: tm_relay_q32) -> their kind and zero point, float16 scales a 32
Q32_KINDS = {2: ("q4", 8), 6: ("q5", 16), 8: ("q8", 0)}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded extension, its argument types declared; None where it is not built or the
    CPU lacks AVX2/FMA (the torch backends compute there)."""
    try:
        from tokenmill import _qgemm
    except ImportError:
        logger.info("C kernels not built; the torch backends compute")
        return None
    lib = ctypes.CDLL(_qgemm.__file__)
    abi.bind(lib)
    check_layouts()
    if not lib.tm_cpu_supported():
        logger.info("CPU lacks AVX2/FMA; the torch backends compute")
        return None
    isa = lib.tm_qgemm_isa().decode()
    logger.info("packed matmul: int8 dot products on %s", isa)
    wanted = os.environ.get("TOKENMILL_ISA")
    if wanted and wanted != isa:
        logger.warning("TOKENMILL_ISA=%s is not a path this CPU runs; %s runs", wanted, isa)
    _fp8_table()  # built now: a decode step being recorded must not compute it
    return lib


def available() -> bool:
    return library() is not None


def isa() -> str | None:
    """The instructions the packed matmul's int8 mode runs on: "amx" (AVX512-VNNI, and AMX
    tiles from 16 rows), "avx512vnni", "avxvnni" or "avx2" (chosen at load: the fastest the
    CPU has, or ``TOKENMILL_ISA``'s); None where the kernels are not available."""
    lib = library()
    return None if lib is None else lib.tm_qgemm_isa().decode()


def supports(w: PackedWeight) -> bool:
    """Whether the kernel handles this weight's layout (else the torch reference runs); half
    weights (HALF_KINDS) have their own kernel, ``half_gemm``."""
    from tokenmill.quant.packed import HALF_KINDS, K_QUANT_GROUP

    if w.kind in HALF_KINDS or w.kind == "f8":  # halves: half_gemm; fp8: quant/fp8.py
        return False
    n, k = w.shape
    if w.kind in K_QUANT_GROUP:  # whole super-blocks, their float16 d (and dmin)
        return (
            k % 256 == 0
            and w.group == K_QUANT_GROUP[w.kind]
            and w.scales.dtype == torch.float16
            and w.codes.device.type == "cpu"
        )
    chunks = w.group // 32  # the kernel needs G = 16 or 32 · 2^j
    group_ok = w.group == 16 or (w.group % 32 == 0 and chunks & (chunks - 1) == 0)
    # float16 scales come from Q8_0 / Q5_0 / Q4_0 / IQ4_NL only: 32-element groups;
    # 16-element groups from Q6_K only (byte codes, "u8").
    scales_ok = w.scales.dtype == torch.float32 or (
        w.scales.dtype == torch.float16 and w.group % 32 == 0
    )
    # rows of a multiple of 64 elements: codes in the kernel's lane order (quant/packed.py)
    return (
        k % w.group == 0
        and k % 64 == 0
        and group_ok
        and scales_ok
        and not (w.kind in ("q4", "n4", "m4", "q5") and w.group == 16)
        and w.codes.device.type == "cpu"
    )


def kind_code(w: PackedWeight) -> int:
    """The kernels' ``kind`` argument for ``w``: its layout, float16 scales, zero point
    (csrc/tokenmill.h: TM_KIND_*)."""
    return abi.kind_code(w.kind, w.scales.dtype == torch.float16, w.zero)


def check_layouts() -> None:
    """quant/packed.py's k-quant tables against the header's TM_LAYOUTS, whose rows the C
    kernels read: a super-block's bytes, where its scale bytes start, its sub-blocks and its
    float16 scales. A disagreement would have the kernels read the weights' bytes wrong, so it
    stops the load (RuntimeError) instead."""
    from tokenmill.quant.packed import (
        K_QUANT_GROUP,
        K_QUANT_KINDS,
        K_QUANT_KINDS_WITH_MIN,
        PACKED_KINDS,
    )

    layouts = abi.layouts()
    wrong = sorted(set(PACKED_KINDS) ^ set(layouts))
    for kind, (block_bytes, scales_at) in K_QUANT_KINDS.items():
        c = layouts.get(kind)
        ds = 2 if kind in K_QUANT_KINDS_WITH_MIN else 1
        if c is None or (c.block_bytes, c.scales_at, c.group, c.ds) != (
            block_bytes,
            scales_at,
            K_QUANT_GROUP[kind],
            ds,
        ):
            wrong.append(kind)
    wrong += [k for k, c in layouts.items() if c.block_bytes and k not in K_QUANT_KINDS]
    if wrong:
        raise RuntimeError(
            f"csrc/tokenmill.h's TM_LAYOUTS and quant/packed.py disagree on {sorted(set(wrong))}"
        )


def qgemm(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None,
    act_int8: bool,
    out: torch.Tensor | None = None,
    q8_unsigned: bool = False,
) -> torch.Tensor:
    """y[M, N] = x[M, K] · Wᵀ (+ bias) in float32 with the C kernel (for ``supports(w)``), into
    ``out`` when given (float32, contiguous, [M, N]). ``q8_unsigned`` (with int8 activations):
    "q8" (and "n4") codes run as unsigned bytes against 7-bit activations, faster
    (packed.activation_levels).
    """
    lib = library()
    assert lib is not None  # the backend checked supports(w)
    x = x.float().contiguous()
    m, k = x.shape
    y = out if out is not None else torch.empty(m, w.shape[0], dtype=torch.float32)
    assert y.shape == (m, w.shape[0]) and y.dtype == torch.float32 and y.is_contiguous()
    rc = launch(
        OP_QGEMM,
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


def relays(ggml_type: int, shape: tuple[int, int]) -> bool:
    """Whether relay_gguf re-lays a tensor of this type and shape [rows, cols]: RELAID_TYPES,
    with the C library built, and rows in the kernel's lane order (Q4_0, Q5_0, Q8_0: cols a
    multiple of 64; the k-quants' whole super-blocks always are). Other rows the torch code
    packs."""
    if ggml_type not in RELAID_TYPES or library() is None:
        return False
    return shape[1] % (64 if ggml_type in Q32_KINDS else 256) == 0


def relayed_bytes(
    ggml_type: int, shape: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes (uint8) of what relay_gguf makes of a tensor [rows, cols] of RELAID_TYPES: its
    codes and its float16 scales (Q4_0, Q5_0, Q8_0: d a 32; the k-quants: d, and dmin, a
    256)."""
    from tokenmill.quant.packed import (
        K_QUANT_KINDS,
        K_QUANT_KINDS_WITH_MIN,
        K_QUANT_TYPES,
        lane_blocks,
    )

    rows, cols = shape
    if ggml_type in Q32_KINDS:
        kind = Q32_KINDS[ggml_type][0]
        # "q5": its low 4 bits as "q4"'s and a 32-byte plane of fifth bits a block of chunks
        planes = 32 * len(lane_blocks(cols)) if kind == "q5" else 0
        codes = cols if kind == "q8" else cols // 2 + planes
        return (rows, codes), (rows, cols // 32 * 2)
    kind = K_QUANT_TYPES[ggml_type]
    d_bytes = 4 if kind in K_QUANT_KINDS_WITH_MIN else 2
    return (rows, cols // 256 * K_QUANT_KINDS[kind][0]), (rows, cols // 256 * d_bytes)


def relay_gguf(
    raw: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, int],
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PackedWeight | None:
    """A GGUF tensor of RELAID_TYPES (raw: its uint8 bytes) re-laid in one pass (csrc/relay.c):
    Q4_0 / Q5_0 / Q8_0 as "q4" / "q5" / "q8", Q4_K / Q5_K / Q6_K / IQ4_XS as "q4k" / "q5k" /
    "q6k" / "n4k":
    what pack_gguf builds, its twin, bit for bit; None where it does not re-lay the tensor
    (``relays``). ``out``: contiguous uint8 tensors of relayed_bytes' shapes to write the codes
    and d into (the loader's place for a part of a joined weight), else new ones."""
    from tokenmill.quant.packed import K_QUANT_GROUP, K_QUANT_TYPES, K_QUANT_ZERO, PackedWeight

    if not relays(ggml_type, shape):
        return None
    lib = library()
    codes_shape, d_shape = relayed_bytes(ggml_type, shape)
    if out is None:
        out = torch.empty(codes_shape, dtype=torch.uint8), torch.empty(d_shape, dtype=torch.uint8)
    codes, d = out
    if codes.shape != codes_shape or d.shape != d_shape:
        raise ValueError(f"relay_gguf: out must be uint8 {codes_shape} and {d_shape}")
    if not (codes.is_contiguous() and d.is_contiguous()):
        raise ValueError("relay_gguf: out tensors must be contiguous")
    raw = raw.contiguous()
    scales = d.view(torch.float16)
    if ggml_type in Q32_KINDS:
        lib.tm_relay_q32(ggml_type, raw.data_ptr(), *shape, codes.data_ptr(), d.data_ptr())
        kind, zero = Q32_KINDS[ggml_type]
        codes = codes.view(torch.int8) if kind == "q8" else codes  # "q8": signed codes
        return PackedWeight(kind, codes, scales, None, 32, shape, zero)
    num_blocks = shape[0] * shape[1] // 256
    lib.tm_relay_kquant(ggml_type, raw.data_ptr(), num_blocks, codes.data_ptr(), d.data_ptr())
    kind = K_QUANT_TYPES[ggml_type]
    return PackedWeight(kind, codes, scales, None, K_QUANT_GROUP[kind], shape, K_QUANT_ZERO[kind])


def dequantize_rows(w: PackedWeight, start: int, end: int) -> torch.Tensor:
    """Float32 rows [start, end) of W with the C kernel (a tile for a float GEMM)."""
    lib = library()
    assert lib is not None  # the backend checked supports(w)
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


def is_dense_f32(*tensors: torch.Tensor) -> bool:
    """Float32, contiguous CPU tensors: what the decode-step kernels read and write."""
    return all(
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
    x is dense, or [tokens, heads, dim] with dense heads (``has_dense_heads``); out is dense."""
    lib = library()
    assert lib is not None
    out = torch.empty(x.shape, dtype=torch.float32)
    dim = x.shape[-1]
    inner, outer_stride = (x.shape[1], x.stride(0)) if not x.is_contiguous() else (1, dim)
    launch(
        OP_RMSNORM,
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


def has_dense_heads(x: torch.Tensor) -> bool:
    """Whether ``rmsnorm``, ``rope_neox_`` and ``decode_attention`` read x: float32 CPU, dense,
    or [tokens, heads, dim] with each token's heads dense (q or k viewed in a fused q/k/v
    projection's output)."""
    if x.is_contiguous():
        return is_dense_f32(x)
    heads_dense = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    return heads_dense and x.dtype == torch.float32 and x.device.type == "cpu"


def rope_neox_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_dim] (``has_dense_heads``) in place; positions int64
    [tokens]."""
    lib = library()
    assert lib is not None
    tokens, heads, dim = x.shape
    launch(OP_ROPE, lib.tm_rope_neox, x, x.stride(0), positions, cos, sin, tokens, heads, dim)
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
    """One query per sequence (q [nd, heads, head_dim], ``has_dense_heads``) against its paged K/V
    (float32 or float16, or int8 / fp8 e4m3 with per-token-per-head scales); int64 tables."""
    lib = library()
    assert lib is not None
    nd, heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    rc = launch(
        OP_ATTN,
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


def prefill_attention(
    q: torch.Tensor,  # [queries, heads, head_dim] at positions q0, q0 + 1, ...
    keys: torch.Tensor,  # [keys, kv_heads, head_dim] at positions k0, ..., the last query's
    values: torch.Tensor,
    q0: int,
    k0: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Causal (and windowed) attention of a run of queries to the keys that end at its last
    query (tokenmill/csrc/prefill_attn.c; float32 CPU tensors, head_dim a multiple of 16). Not
    recorded: a decode step's graph never holds a prefill."""
    lib = library()
    assert lib is not None
    q, keys, values = (t.float().contiguous() for t in (q, keys, values))
    (n, heads, dim), (nk, kv_heads, _) = q.shape, keys.shape
    if q0 + n != k0 + nk:
        raise ValueError(f"keys must end at the last query: {q0}+{n} queries, {k0}+{nk} keys")
    out = torch.empty(q.shape, dtype=torch.float32)
    rc = lib.tm_prefill_attn(
        q.data_ptr(), keys.data_ptr(), values.data_ptr(), n, nk, heads, kv_heads, dim, q0, k0,
        window or 0, float(scale), out.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("prefill attention could not allocate its scratch")
    return out


@functools.cache
def _fp8_table() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 bytes (the kernel decodes fp8 through it)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def embed_rows(w: PackedWeight, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Float32 rows ``ids`` (int64, contiguous) of a packed table, times ``scale``."""
    lib = library()
    assert lib is not None  # the backend checked supports(w)
    out = torch.empty(ids.numel(), w.shape[1], dtype=torch.float32)
    launch(
        OP_EMBED,
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
    lib = library()
    assert lib is not None
    n, d = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, d, dtype=torch.float32)
    launch(OP_ACT_MUL, lib.tm_act_mul, gate_up, n, d, 2 * d, ACTIVATIONS[act], out)
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
    lib = library()
    assert lib is not None
    if scales is None:
        launch(
            OP_KV_WRITE,
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
    launch(
        OP_KV_WRITE_Q8,
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
    lib = library()
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if lib.tm_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()) != 0:
        return None
    return out


def apply_bitmask(row: torch.Tensor, mask: torch.Tensor) -> None:
    """row[t] = -inf where bit t of mask (int32 words) is 0, in place: a dense float32 row."""
    lib = library()
    assert lib is not None
    lib.tm_apply_bitmask(row.data_ptr(), mask.data_ptr(), row.numel())


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for two dense float32 tensors of one shape (the residual stream's add)."""
    lib = library()
    assert lib is not None
    out = torch.empty(a.shape, dtype=torch.float32)
    launch(OP_ADD, lib.tm_add, a, b, out, a.numel())
    return out


def gather_rows(table: torch.Tensor, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rows ``ids`` (int64, contiguous) of a dense float32 table [vocab, dim], times ``scale``."""
    lib = library()
    assert lib is not None
    out = torch.empty(ids.numel(), table.shape[1], dtype=torch.float32)
    launch(
        OP_GATHER, lib.tm_gather_rows, ids, ids.numel(), table.shape[1], table, float(scale), out
    )
    return out.reshape(*ids.shape, table.shape[1])


def moe_route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token of x [T, H] by softmax(x routerᵀ) (router [E, H],
    E <= MOE_MAX_EXPERTS; both dense float32), highest first, ties to the lower index: (weights
    float32 [T, k], ids int64 [T, k]); ``renormalize``: the k weights rescaled to sum to 1."""
    lib = library()
    assert lib is not None
    num_tokens, hidden = x.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    launch(
        OP_MOE_ROUTE,
        lib.tm_moe_route,
        x,
        num_tokens,
        hidden,
        router,
        router.shape[0],
        top_k,
        int(renormalize),
        weights,
        ids,
    )
    return weights, ids


def moe_work_bytes(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int) -> int:
    """Bytes of the scratch buffer ``moe_experts`` hands its kernel (the layout is moe.c's)."""
    lib = library()
    assert lib is not None
    return lib.tm_moe_work_bytes(num_tokens, hidden, inter, num_experts, top_k)


def _moe_descriptor(gate_up: PackedWeight, down: PackedWeight, num_experts: int) -> torch.Tensor:
    """moe.c's descriptor of two stacked expert weights (int64 [18]): E, I, then per weight
    its kind, codes / scales / offsets addresses, group and per-expert byte strides. Built in
    numpy: a decode step being recorded runs no torch op outside the kernels. The addresses
    point into the weights, which the model keeps alive."""
    fields = [num_experts, down.shape[1]]
    for w in (gate_up, down):
        tensors = (w.codes, w.scales, w.offsets)
        rows = w.shape[0] // num_experts
        fields += [kind_code(w)]
        fields += [0 if t is None else t.data_ptr() for t in tensors]
        fields += [w.group]
        fields += [0 if t is None else rows * t.stride(0) * t.element_size() for t in tensors]
    return torch.from_numpy(np.array(fields, dtype=np.int64))


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: PackedWeight,
    down: PackedWeight,
    act: str,
    act_int8: bool,
    counts: torch.Tensor | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_j weights[t, j] · down_e(act(gate_e x_t) · up_e x_t), e = ids[t, j], float32 [T, H]
    (KernelBackend.moe_experts) with the C kernels, for dense float32 x, weights, shared and
    shared_gate, int64 ids and counts, and contiguous stacked weights that ``supports``."""
    lib = library()
    assert lib is not None
    num_tokens, hidden = x.shape
    inter, top_k = down.shape[1], ids.shape[1]
    num_experts = down.shape[0] // hidden
    out = torch.empty(num_tokens, hidden, dtype=torch.float32)
    work = torch.empty(
        moe_work_bytes(num_tokens, hidden, inter, num_experts, top_k), dtype=torch.uint8
    )
    rc = launch(
        OP_MOE_EXPERTS,
        lib.tm_moe_experts,
        num_tokens,
        hidden,
        x,
        top_k,
        weights,
        ids,
        _moe_descriptor(gate_up, down, num_experts),
        ACTIVATIONS[act],
        int(act_int8),
        counts,
        shared,
        shared_gate,
        out,
        work,
    )
    if rc != 0:
        raise MemoryError("moe experts' matmul could not allocate its activation buffer")
    return out


def half_gemm(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y[M, N] = x[M, K] · Wᵀ (+ bias) in float32 for a float16 / bfloat16 weight (HALF_KINDS,
    codes contiguous), each weight widened as it is read (csrc/half.c)."""
    lib = library()
    assert lib is not None
    x = x.float().contiguous()
    m, k = x.shape
    y = out if out is not None else torch.empty(m, w.shape[0], dtype=torch.float32)
    launch(
        OP_HALF_GEMM, lib.tm_half_gemm, m, w.shape[0], k, x, w.codes, int(w.kind == "bf16"), bias, y
    )
    return y


def half_rows(w: PackedWeight, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Float32 rows ``ids`` (int64, contiguous) of a half table, times ``scale``."""
    lib = library()
    assert lib is not None
    out = torch.empty(ids.numel(), w.shape[1], dtype=torch.float32)
    launch(
        OP_HALF_ROWS,
        lib.tm_half_rows,
        ids,
        ids.numel(),
        w.shape[1],
        w.codes,
        int(w.kind == "bf16"),
        float(scale),
        out,
    )
    return out.reshape(*ids.shape, w.shape[1])
