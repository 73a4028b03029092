"""Hardware probes for the capacity planner: how fast the kernels the engine runs go here.

Each probe times one kernel on random data (the median of repeated calls), with the backend the
engine would pick (the C kernels where they load, else torch), on the shapes of the model being
planned, so the planner's terms are this machine's rates for the engine's own code, not
datasheet peaks:

- weight streaming: a packed int8 matmul of one row over 256 MiB of codes (a decode step's
  weight reads), as one matrix (an output head) and as many of a layer's matrix size (a call
  each, as a step makes them), in bytes per second;
- matmul throughput: for each matmul kind asked for, "TYPE@K" (a GGUF type such as "Q4_K",
  "F32" for float weights, "int8" / "int4" for --quantization; K inputs), the kernel the engine
  runs for it with 16, 64, 256 and 512 rows against a [2048, K] weight of random codes (a step's
  linear layers), in multiply-adds x 2 per second;
- decode attention: sequences of 512 tokens whose K/V fill 256 MiB (read from memory, as an
  engine's KV pool is), with the model's query heads, KV heads and head dim;
- prefill attention: a causal 512-token prompt, the same heads, through SDPA as prefills run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_library as lib
from tokenmill.kernels import create_kernel_backend
from tokenmill.quant.gguf_blocks import BLOCK_CODES
from tokenmill.quant.packed import (
    HALF_GGML_TYPES,
    HALF_KINDS,
    PackedWeight,
    pack_codes,
    pack_gguf,
    pack_half,
)

__all__ = ["ProbeResult", "parse_kind", "probe_cpu"]

GEMM_ROWS = (16, 64, 256, 512)
_STREAM_BYTES = 256 << 20
_GEMM_OUTPUTS = 2048  # N of the probed weights [N, K]
# GGUF type name -> ggml id, and where a block's float16 scales sit (Q4_1, Q5_1, Q4_K, Q5_K: d
# and m / dmin first; Q6_K: d last; the others: d first).
_GGUF_IDS = {"F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
             "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20,
             "IQ4_XS": 23}  # fmt: skip
# Where each block keeps its float16 scales (d, and dmin / m where there is one).
_SCALE_OFFSETS = {3: (0, 2), 7: (0, 2), 10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2),
                  14: (208,)}  # fmt: skip
_CONTEXT, _SEQS, _BLOCK = 512, 16, 16
_DECODE_KV_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Rates measured here with ``threads`` threads (see the module docstring)."""

    stream_bytes_per_s: float  # one matrix of 256 MiB (an output head)
    layer_stream_bytes_per_s: float  # matrices of a layer's size
    gemm_ops_per_s: dict[str, dict[int, float]]  # matmul kind -> rows -> 2 x multiply-adds / s
    decode_attention_flops: float
    prefill_attention_flops: float
    threads: int
    backend: str  # "C kernels (<isa>)" or "torch"


def _typical(fn: Callable[[], object], runs: int = 5, budget_s: float = 0.3) -> float:
    """The median of at least ``runs`` calls, more while under ``budget_s``: what a kernel
    sustains call after call (the engine's steps run back to back), robust to the odd stall of
    a shared machine."""
    fn()  # warm caches and lazily built state
    times: list[float] = []
    while len(times) < runs or sum(times) < budget_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _int8_weight(n: int, k: int, gen: torch.Generator) -> PackedWeight:
    codes = torch.randint(-128, 128, (n, k), generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    return PackedWeight("q8", pack_codes(codes, "q8"), scales, None, 32, (n, k))


def _weight(weight_type: str, n: int, k: int, gen: torch.Generator) -> PackedWeight | torch.Tensor:
    """A random [n, k] weight held as the engine holds ``weight_type``."""
    if weight_type == "F32":
        return torch.randn(n, k, generator=gen)
    if weight_type in ("int8", "int4"):
        from tokenmill.quant import create_quant_method

        method = create_quant_method(weight_type, packed_activations="int8")
        return method.quantize(torch.randn(n, k, generator=gen), None).weight
    ggml_type = _GGUF_IDS.get(weight_type)
    if ggml_type is None:
        raise ValueError(f"no probe for weight type {weight_type!r}")
    if ggml_type in HALF_GGML_TYPES:  # F16 / BF16: kept as halves
        halves = torch.randn(n, k, generator=gen).to(HALF_KINDS[HALF_GGML_TYPES[ggml_type]])
        return pack_half(halves.view(torch.uint8).reshape(-1), ggml_type, (n, k))
    elems, nbytes, _ = BLOCK_CODES[ggml_type]
    blocks = n * k // elems
    data = torch.randint(0, 256, (blocks, nbytes), dtype=torch.uint8, generator=gen)
    for off in _SCALE_OFFSETS.get(ggml_type, (0,)):  # finite, modest float16 scales
        d = (torch.rand(blocks, generator=gen) * 0.02).half()
        data[:, off : off + 2] = d.view(torch.uint8).reshape(blocks, 2)
    return pack_gguf(data.reshape(-1), ggml_type, (n, k))


def parse_kind(kind: str) -> tuple[str, int]:
    """ "Q5_0@640" -> ("Q5_0", 640): a weight type and the input size of its matmul."""
    weight_type, sep, k = kind.partition("@")
    if not sep or not k.isdigit() or int(k) < 1:
        raise ValueError(f"a matmul kind reads TYPE@K, e.g. Q4_K@4096; got {kind!r}")
    return weight_type, int(k)


def _matmul_rate(kind: str, rows: int, use_c: bool, gen: torch.Generator) -> float:
    weight_type, k = parse_kind(kind)
    n = _GEMM_OUTPUTS
    w = _weight(weight_type, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    if isinstance(w, torch.Tensor):
        run = lambda: F.linear(x, w)  # noqa: E731
    else:
        backend = create_kernel_backend("cpu" if use_c else "torch")
        run = lambda: backend.packed_matmul(x, w, None, True)  # noqa: E731
    return 2 * rows * n * k / _typical(run)


def probe_cpu(
    threads: int | None = None,
    matmul_kinds: Iterable[str] = ("Q8_0@1024",),
    attention_heads: tuple[int, int, int] = (8, 2, 128),
    layer_matrix_bytes: int = 4 << 20,
) -> ProbeResult:
    """Run the probes (a few seconds) with ``threads`` torch threads (default: torch's): the
    matmuls of each of ``matmul_kinds`` ("TYPE@K", see parse_kind) and attention with
    ``attention_heads`` = (query heads, KV heads, head dim), the planned model's; weight
    streaming through one big matrix and through many of ``layer_matrix_bytes``."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        use_c = lib.available()
        gemm = {
            kind: {rows: _matmul_rate(kind, rows, use_c, gen) for rows in GEMM_ROWS}
            for kind in dict.fromkeys(matmul_kinds)
        }
        return ProbeResult(
            stream_bytes_per_s=_stream_rate(use_c, gen, _STREAM_BYTES),
            layer_stream_bytes_per_s=_stream_rate(use_c, gen, layer_matrix_bytes),
            gemm_ops_per_s=gemm,
            decode_attention_flops=_decode_attention_rate(use_c, gen, *attention_heads),
            prefill_attention_flops=_prefill_attention_rate(gen, *attention_heads),
            threads=torch.get_num_threads(),
            backend=f"C kernels ({lib.isa()})" if use_c else "torch",
        )
    finally:
        torch.set_num_threads(saved)


def _stream_rate(use_c: bool, gen: torch.Generator, matrix_bytes: int) -> float:
    """One row through matrices of ``matrix_bytes`` each, 256 MiB of them in all (more than any
    cache), one call a matrix as a decode step makes: bytes per second, the calls' own costs
    (thread hand-offs) included."""
    k = 1024
    rows = max(64, min(_STREAM_BYTES, matrix_bytes) // k // 64 * 64)
    mats = [_int8_weight(rows, k, gen) for _ in range(max(1, _STREAM_BYTES // (rows * k)))]
    x = torch.randn(1, k, generator=gen)
    if use_c:
        run = lambda: [lib.qgemm(x, w, None, True, None, True) for w in mats]  # noqa: E731
        return sum(w.nbytes for w in mats) / _typical(run)
    dense = [w.dequantize() for w in mats]  # torch dequantizes first: a float32 read
    run = lambda: [F.linear(x, w) for w in dense]  # noqa: E731
    return sum(w.numel() * 4 for w in dense) / _typical(run)


def _decode_attention_rate(
    use_c: bool, gen: torch.Generator, heads: int, kv_heads: int, head_dim: int
) -> float:
    # NOTE: enough sequences that their K/V (float32) outgrow any cache, as an engine's KV pool
    # does: a cache-resident probe ran twice as fast as the engine's decode attention.
    seqs = max(_SEQS, -(-_DECODE_KV_BYTES // (_CONTEXT * kv_heads * head_dim * 8)))
    blocks_per_seq = _CONTEXT // _BLOCK
    num_blocks = seqs * blocks_per_seq
    k_cache, v_cache = torch.randn(2, num_blocks, _BLOCK, kv_heads, head_dim, generator=gen)
    table = torch.arange(num_blocks).reshape(seqs, blocks_per_seq)  # a fresh pool: in order
    seq_lens = torch.full((seqs,), _CONTEXT, dtype=torch.long)
    q = torch.randn(seqs, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    if use_c:
        run = lambda: lib.decode_attention(q, k_cache, v_cache, table, seq_lens, None, scale)  # noqa: E731
    else:
        keys = k_cache[table].reshape(seqs, _CONTEXT, kv_heads, head_dim).transpose(1, 2)
        values = v_cache[table].reshape(seqs, _CONTEXT, kv_heads, head_dim).transpose(1, 2)
        run = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True
        )
    flops = 4 * seqs * heads * head_dim * _CONTEXT  # q·k and p·v, 2 flops a multiply-add
    return flops / _typical(run)


def _prefill_attention_rate(
    gen: torch.Generator, heads: int, kv_heads: int, head_dim: int
) -> float:
    q = torch.randn(1, heads, _CONTEXT, head_dim, generator=gen)
    k, v = torch.randn(2, 1, kv_heads, _CONTEXT, head_dim, generator=gen)
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    flops = 4 * heads * head_dim * _CONTEXT * (_CONTEXT + 1) / 2  # the causal half
    return flops / _typical(run)
