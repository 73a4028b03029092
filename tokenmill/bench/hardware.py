"""What the planner knows of a machine: rates, memory, price, and the engine's own host work.

A preset is a datasheet (peak memory bandwidth, dense bf16 tensor throughput, memory) with the
fractions of it a serving engine reaches in practice, stated beside it; ``measure`` probes this
machine with the engine's own kernels (kernels/probe.py), so its rates need no such fraction.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

__all__ = ["HARDWARE_PRESETS", "Hardware", "hardware_named", "measure_hardware"]


@dataclass(frozen=True, slots=True)
class Hardware:
    """One machine as the roofline sees it. Rates are what the engine's kernels reach.

    ``matmul_ops_per_s`` maps a number of rows (tokens in a step) to the linear layers' rate at
    that size; between the probed sizes the rate is read off the nearest smaller one (below the
    smallest, the smallest's: there the weights' reads bind, not this rate).
    """

    name: str
    bandwidth_bytes_per_s: float  # weights and KV cache streamed from memory
    matmul_ops_per_s: dict[int, float]  # rows -> 2 x multiply-adds per second
    decode_attention_flops: float  # one query a sequence against its cached K/V
    prefill_attention_flops: float  # causal attention inside a prompt
    memory_bytes: int
    price_per_hour: float = 0.0  # USD
    # Host work each step: scheduling, sampling, outputs (a fixed part and a part per request).
    step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    # Weights streamed through a layer's smaller matrices, a call each (None: the bandwidth).
    layer_bandwidth_bytes_per_s: float | None = None
    # Per matmul kind "TYPE@K" where kernels differ (a CPU's packed layouts): kind -> rows -> rate.
    matmul_ops_by_kind: dict[str, dict[int, float]] = field(default_factory=dict)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def matmul_rate(self, rows: int, kind: str | None = None) -> float:
        """The linear layers' rate at ``rows`` rows for weights of ``kind`` ("TYPE@K")."""
        rates = self.matmul_ops_by_kind.get(kind or "", self.matmul_ops_per_s)
        sizes = sorted(rates)
        idx = max(0, bisect.bisect_right(sizes, rows) - 1)
        return rates[sizes[idx]]


def _gpu(
    name: str, bandwidth_tbs: float, bf16_tflops: float, memory_gb: float, price: float
) -> Hardware:
    # NOTE: the fractions below are what vLLM-class engines commonly reach on these parts
    # (decode streams ~80% of peak bandwidth; prefill GEMMs ~60% of dense peak; attention
    # kernels about half of that), not figures measured by tokenmill: no GPU was at hand.
    bw, flops = bandwidth_tbs * 1e12 * 0.8, bf16_tflops * 1e12
    return Hardware(
        name=name,
        bandwidth_bytes_per_s=bw,
        matmul_ops_per_s={1: flops * 0.3, 64: flops * 0.5, 256: flops * 0.6},
        decode_attention_flops=flops * 0.3,
        prefill_attention_flops=flops * 0.4,
        memory_bytes=int(memory_gb * 1e9),
        price_per_hour=price,
        step_overhead_s=0.3e-3,  # a CUDA-graph step's launch and host work
        request_overhead_s=5e-6,
        notes=(
            f"datasheet: {bandwidth_tbs} TB/s, {bf16_tflops:g} dense bf16 TFLOP/s, "
            f"{memory_gb:g} GB; assumed 80% of bandwidth, 30-60% of compute",
            f"price: ${price}/h, a typical on-demand cloud rate (set --price-per-hour)",
        ),
    )


HARDWARE_PRESETS: dict[str, Hardware] = {
    "h200": _gpu("NVIDIA H200 SXM", 4.8, 989, 141, 3.50),
    "h100": _gpu("NVIDIA H100 SXM", 3.35, 989, 80, 2.50),
    "a100": _gpu("NVIDIA A100 SXM 80GB", 2.039, 312, 80, 1.50),
    "l4": _gpu("NVIDIA L4", 0.3, 121, 24, 0.70),
}

# The CPU engine's host work each step, from benchmarks/decode_breakdown.py (graphed decode,
# gemma-3-270m: 0.30 ms a step at batch 1, 1.04 ms at batch 16; AMD EPYC Zen 5, 2 threads).
CPU_STEP_OVERHEAD_S = 0.25e-3
CPU_REQUEST_OVERHEAD_S = 0.05e-3


def hardware_named(name: str) -> Hardware:
    """A preset by name (case-insensitive); ValueError listing the choices."""
    key = name.lower()
    if key not in HARDWARE_PRESETS:
        choices = ", ".join([*HARDWARE_PRESETS, "measure"])
        raise ValueError(f"--hardware must be one of {choices}; got {name!r}")
    return HARDWARE_PRESETS[key]


def measure_hardware(
    matmul_kinds: tuple[str, ...],
    attention_heads: tuple[int, int, int],
    layer_matrix_bytes: int,
    threads: int | None = None,
    price_per_hour: float = 0.0,
) -> Hardware:
    """This machine, probed with the engine's kernels on a model's matmul kinds ("TYPE@K"),
    attention heads and layer matrix size (a few seconds a kind); its memory is what is
    available now."""
    from tokenmill.kernels.probe import probe_cpu
    from tokenmill.memory import available_memory

    probe = probe_cpu(threads, matmul_kinds, attention_heads, layer_matrix_bytes)
    by_kind = probe.gemm_ops_per_s
    return Hardware(
        name=f"this machine ({probe.threads} threads, {probe.backend})",
        bandwidth_bytes_per_s=probe.stream_bytes_per_s,
        layer_bandwidth_bytes_per_s=probe.layer_stream_bytes_per_s,
        matmul_ops_per_s=by_kind[matmul_kinds[0]],
        decode_attention_flops=probe.decode_attention_flops,
        prefill_attention_flops=probe.prefill_attention_flops,
        memory_bytes=available_memory() or 0,
        price_per_hour=price_per_hour,
        step_overhead_s=CPU_STEP_OVERHEAD_S,
        request_overhead_s=CPU_REQUEST_OVERHEAD_S,
        matmul_ops_by_kind=by_kind,
        notes=(
            f"weights stream at {probe.stream_bytes_per_s / 1e9:.0f} GB/s through one big matrix, "
            f"{probe.layer_stream_bytes_per_s / 1e9:.0f} GB/s through a layer's",
            "rates probed just now with the engine's kernels (kernels/probe.py), GOP/s: "
            + ", ".join(f"{k} {max(r.values()) / 1e9:.0f}" for k, r in by_kind.items()),
            f"attention GFLOP/s: decode {probe.decode_attention_flops / 1e9:.0f}, prefill "
            f"{probe.prefill_attention_flops / 1e9:.0f}",
        ),
    )


def with_price(hw: Hardware, price_per_hour: float | None) -> Hardware:
    return hw if price_per_hour is None else replace(hw, price_per_hour=price_per_hour)
