"""Weight-only int8 / int4 matmuls on a GPU at gemma-3-270m's shapes: tokenmill's Triton
dequant-matmul (at several tile sizes) against cuBLAS bf16 and torch's own kernels
(``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm``), at 1 and 256 rows.

    OUT=dir python benchmarks/gpu_quant_matmul.py     # writes $OUT/quant_matmul.json

Each figure is the mean of 50 calls after 5 warm-ups, timed with CUDA events (microseconds).
A kernel that fails (a shape torch's kernel does not take) records its error instead.
``--device cpu`` runs the same code at tiny sizes in Triton's interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.kernels.triton.quant_matmul import packed_matmul
from tokenmill.quant.int8 import Int8QuantMethod
from tokenmill.quant.packed import quantize_int4

# (out, in) of each projection: q/k/v, o, gate/up, down, the tied head.
SHAPES = {
    "qkv": (1536, 640),
    "o": (640, 1024),
    "gate_up": (4096, 640),
    "down": (640, 2048),
    "head": (262144, 640),
}
TILES = [(64, 64), (32, 128), (16, 256), (32, 256)]  # (block_n, block_k)


def time_us(fn: Callable[[], object], device: torch.device, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps * 1e3


def attempt(fn: Callable[[], float]) -> float | str:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - each kernel reports its own failure
        return f"{type(e).__name__}: {str(e)[:160]}"


def torch_int4(w: torch.Tensor, x: torch.Tensor, group: int) -> Callable[[], object]:
    """torch's tinygemm int4 kernel over w quantized asymmetrically per ``group`` inputs."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    codes = codes.view(n, k)
    packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]), 8)
    zeros = lo + 8 * scale  # tinygemm: w = (code - 8) * scale + zero
    scales_zeros = torch.stack([scale, zeros], -1).transpose(0, 1).contiguous().bfloat16()
    return lambda: torch._weight_int4pack_mm(x, packed, group, scales_zeros)


def measure(x: torch.Tensor, w: torch.Tensor, q8, q4, device: torch.device) -> dict:
    """Every kernel's time for x [rows, in] against one weight w [out, in] (float32, on the
    host) and its packed forms ``q8`` / ``q4`` (on the device; q4 may be None)."""
    w16 = w.bfloat16().to(device)
    wq = (w / w.abs().amax(1, keepdim=True) * 127).round().to(torch.int8).to(device)
    s16 = (w.abs().amax(1) / 127).bfloat16().to(device)
    row: dict = {"bf16_cublas": attempt(lambda: time_us(lambda: x @ w16.T, device))}
    for bn, bk in TILES:
        for kind, pw in (("int8", q8), ("int4", q4)):
            if pw is not None:
                row[f"{kind}_triton_{bn}x{bk}"] = attempt(
                    lambda pw=pw, bn=bn, bk=bk: time_us(
                        lambda: packed_matmul(x, pw, None, block_n=bn, block_k=bk), device
                    )
                )
    row["int8_torch"] = attempt(
        lambda: time_us(lambda: torch._weight_int8pack_mm(x, wq, s16), device)
    )
    if q4 is not None:
        row["int4_torch"] = attempt(lambda: time_us(torch_int4(w.to(device), x, 32), device))
    return row


def run(device: torch.device, shapes: dict[str, tuple[int, int]], rows: list[int]) -> dict:
    results: dict = {"device": str(device), "torch": torch.__version__, "figures": {}}
    if device.type == "cuda":
        results["device"] = torch.cuda.get_device_name(device)
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        q8 = Int8QuantMethod().quantize(w, None).weight.to(device)
        # int4 leaves the head int8 (quant/int4.py): its int4 fit would take minutes here.
        q4 = None if name == "head" else quantize_int4(w, 32, None).to(device)
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16().to(device)
            row = measure(x, w, q8, q4, device)
            results["figures"][f"{name} {n}x{k} rows={m}"] = row
            print(name, m, json.dumps(row), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    ns = p.parse_args()
    device = torch.device(ns.device)
    if device.type == "cuda":
        shapes, rows = SHAPES, [1, 256]
    else:  # the interpreter's smoke run
        shapes, rows = {"tiny": (64, 128)}, [1]
    results = run(device, shapes, rows)
    Path(os.environ.get("OUT", "."), "quant_matmul.json").write_text(
        json.dumps(results, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
