"""Hardware probes for the capacity planner: how fast the kernels the engine runs go here.

Each probe times one kernel on random data of a fixed shape (best of a few runs), with the
backend the engine would pick (the C kernels where they load, else torch), so the planner's
terms are this machine's rates for the engine's own code, not datasheet peaks:

- weight streaming: a packed int8 matmul of one row over 256 MiB of codes (a decode step's
  weight reads), in bytes per second;
- matmul throughput: the same kernel with 16, 64 and 256 rows against a [2048, 1024] weight (a
  step's linear layers), in multiply-adds x 2 per second;
- decode attention: 16 sequences of 512 tokens, 8 query heads on 2 KV heads of 128;
- prefill attention: a causal 512-token prompt, the same heads, through SDPA as prefills run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_library as lib
from tokenmill.quant.packed import PackedWeight, pack_codes

__all__ = ["ProbeResult", "probe_cpu"]

GEMM_ROWS = (16, 64, 256)
_STREAM_BYTES = 256 << 20
_GEMM_SHAPE = (2048, 1024)  # [N, K]
_HEADS, _KV_HEADS, _HEAD_DIM, _CONTEXT, _SEQS, _BLOCK = 8, 2, 128, 512, 16, 16


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Rates measured here with ``threads`` threads (see the module docstring)."""

    stream_bytes_per_s: float
    gemm_ops_per_s: dict[int, float]  # rows -> 2 x multiply-adds per second
    decode_attention_flops: float
    prefill_attention_flops: float
    threads: int
    backend: str  # "C kernels (<isa>)" or "torch"


def _best(fn: Callable[[], object], runs: int = 5) -> float:
    fn()  # warm caches and lazily built state
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _int8_weight(n: int, k: int, gen: torch.Generator) -> PackedWeight:
    codes = torch.randint(-128, 128, (n, k), generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    return PackedWeight("q8", pack_codes(codes, "q8"), scales, None, 32, (n, k))


def _matmul(use_c: bool) -> Callable[[torch.Tensor, PackedWeight], torch.Tensor]:
    if use_c:
        return lambda x, w: lib.qgemm(x, w, None, True, None, True)
    return lambda x, w: F.linear(x, w.dequantize())


def probe_cpu(threads: int | None = None) -> ProbeResult:
    """Run the probes (a few seconds) with ``threads`` torch threads (default: torch's)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _probe(torch.get_num_threads())
    finally:
        torch.set_num_threads(saved)


def _probe(threads: int) -> ProbeResult:
    gen = torch.Generator().manual_seed(0)
    use_c = lib.available()
    matmul = _matmul(use_c)
    stream = _stream_rate(use_c, gen)
    w = _int8_weight(*_GEMM_SHAPE, gen)
    gemm = {}
    for rows in GEMM_ROWS:
        x = torch.randn(rows, _GEMM_SHAPE[1], generator=gen)
        gemm[rows] = 2 * rows * w.shape[0] * w.shape[1] / _best(lambda x=x: matmul(x, w))
    backend = f"C kernels ({lib.isa()})" if use_c else "torch"
    return ProbeResult(
        stream_bytes_per_s=stream,
        gemm_ops_per_s=gemm,
        decode_attention_flops=_decode_attention_rate(use_c, gen),
        prefill_attention_flops=_prefill_attention_rate(gen),
        threads=threads,
        backend=backend,
    )


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
