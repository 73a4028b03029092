"""Hardware probes for the capacity planner: how fast the kernels the engine runs go here.

Each probe times one kernel on random data of a fixed shape (best of a few runs), with the
backend the engine would pick (the C kernels where they load, else torch), so the planner's
terms are this machine's rates for the engine's own code, not datasheet peaks:

- weight streaming: a packed int8 matmul of one row over 256 MiB of codes (a decode step's
  weight reads), in bytes per second;
- matmul throughput: for each weight type asked for (a GGUF type such as "Q4_K", "F32" for
  float weights, "int8" / "int4" for --quantization), the kernel the engine runs for it with
  16, 64 and 256 rows against a [2048, 1024] weight of random codes (a step's linear layers),
  in multiply-adds x 2 per second;
- decode attention: 16 sequences of 512 tokens, 8 query heads on 2 KV heads of 128;
- prefill attention: a causal 512-token prompt, the same heads, through SDPA as prefills run.
"""

from __future__ import annotations

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

__all__ = ["ProbeResult", "probe_cpu"]

GEMM_ROWS = (16, 64, 256)
_STREAM_BYTES = 256 << 20
_GEMM_SHAPE = (2048, 1024)  # [N, K]
# GGUF type name -> ggml id, and where a block's float16 scales sit (Q4_1, Q5_1, Q4_K, Q5_K: d
# and m / dmin first; Q6_K: d last; the others: d first).
_GGUF_IDS = {"F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
             "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}  # fmt: skip
_SCALE_OFFSETS = {3: (0, 2), 7: (0, 2), 12: (0, 2), 13: (0, 2), 14: (208,)}
_HEADS, _KV_HEADS, _HEAD_DIM, _CONTEXT, _SEQS, _BLOCK = 8, 2, 128, 512, 16, 16


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Rates measured here with ``threads`` threads (see the module docstring)."""

    stream_bytes_per_s: float
    gemm_ops_per_s: dict[str, dict[int, float]]  # weight type -> rows -> 2 x multiply-adds / s
    decode_attention_flops: float
    prefill_attention_flops: float
    threads: int
    backend: str  # "C kernels (<isa>)" or "torch"


def _best(fn: Callable[[], object], runs: int = 5, budget_s: float = 0.3) -> float:
    """The fastest of at least ``runs`` calls, more while under ``budget_s``: on a shared
    machine one call in a few stalls for milliseconds, and the fastest call is the kernel's."""
    fn()  # warm caches and lazily built state
    best, spent, done = float("inf"), 0.0, 0
    while done < runs or spent < budget_s:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, done = min(best, took), spent + took, done + 1
    return best


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


def _matmul_rate(weight_type: str, rows: int, use_c: bool, gen: torch.Generator) -> float:
    n, k = _GEMM_SHAPE
    w = _weight(weight_type, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    if isinstance(w, torch.Tensor):
        run = lambda: F.linear(x, w)  # noqa: E731
    else:
        backend = create_kernel_backend("cpu" if use_c else "torch")
        run = lambda: backend.packed_matmul(x, w, None, True)  # noqa: E731
    return 2 * rows * n * k / _best(run)


def probe_cpu(threads: int | None = None, weight_types: Iterable[str] = ("Q8_0",)) -> ProbeResult:
    """Run the probes (a few seconds) with ``threads`` torch threads (default: torch's), timing
    the matmuls of each of ``weight_types``."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        use_c = lib.available()
        gemm = {
            t: {rows: _matmul_rate(t, rows, use_c, gen) for rows in GEMM_ROWS}
            for t in dict.fromkeys(weight_types)
        }
        return ProbeResult(
            stream_bytes_per_s=_stream_rate(use_c, gen),
            gemm_ops_per_s=gemm,
            decode_attention_flops=_decode_attention_rate(use_c, gen),
            prefill_attention_flops=_prefill_attention_rate(gen),
            threads=torch.get_num_threads(),
            backend=f"C kernels ({lib.isa()})" if use_c else "torch",
        )
    finally:
        torch.set_num_threads(saved)


def _stream_rate(use_c: bool, gen: torch.Generator) -> float:
    k = 1024
    big = _int8_weight(_STREAM_BYTES // k, k, gen)
    x = torch.randn(1, k, generator=gen)
    if use_c:
        return big.nbytes / _best(lambda: lib.qgemm(x, big, None, True, None, True))
    dense = big.dequantize()  # torch dequantizes first: its stream is a float32 read
    return dense.numel() * 4 / _best(lambda: F.linear(x, dense))


def _decode_attention_rate(use_c: bool, gen: torch.Generator) -> float:
    blocks_per_seq = _CONTEXT // _BLOCK
    num_blocks = _SEQS * blocks_per_seq
    k_cache, v_cache = torch.randn(2, num_blocks, _BLOCK, _KV_HEADS, _HEAD_DIM, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).reshape(_SEQS, blocks_per_seq)
    seq_lens = torch.full((_SEQS,), _CONTEXT, dtype=torch.long)
    q = torch.randn(_SEQS, _HEADS, _HEAD_DIM, generator=gen)
    scale = _HEAD_DIM**-0.5
    if use_c:
        run = lambda: lib.decode_attention(q, k_cache, v_cache, table, seq_lens, None, scale)  # noqa: E731
    else:
        keys = k_cache[table].reshape(_SEQS, _CONTEXT, _KV_HEADS, _HEAD_DIM).transpose(1, 2)
        values = v_cache[table].reshape(_SEQS, _CONTEXT, _KV_HEADS, _HEAD_DIM).transpose(1, 2)
        run = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True
        )
    flops = 4 * _SEQS * _HEADS * _HEAD_DIM * _CONTEXT  # q·k and p·v, 2 flops a multiply-add
    return flops / _best(run)


def _prefill_attention_rate(gen: torch.Generator) -> float:
    q = torch.randn(1, _HEADS, _CONTEXT, _HEAD_DIM, generator=gen)
    k, v = torch.randn(2, 1, _KV_HEADS, _CONTEXT, _HEAD_DIM, generator=gen)
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    flops = 4 * _HEADS * _HEAD_DIM * _CONTEXT * (_CONTEXT + 1) / 2  # the causal half
    return flops / _best(run)
