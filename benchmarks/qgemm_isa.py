"""The packed matmul's int8 mode on each instruction set it can run (tokenmill/csrc/qgemm.c:
maddubs + madd on AVX2, vpdpbusd on AVX-VNNI / AVX512-VNNI), in one process.

The built extension is copied once per instruction set and each copy loaded with
TOKENMILL_ISA naming it (a copy is a separate library with its own choice); the copies are then
called alternately on the same inputs, so every timing pair sees the same machine (this VM's
speed drifts from minute to minute: benchmarks/qgemm_ab.py). Weights are random, in two
layouts: "q4" with float32 scales and offsets in groups of 32 (as Q4_K) and "q8" with float16
scales (as Q8_0, act_int8 = 2 for the output head as the engine runs it); shapes are
gemma-3-270m's projections and head (K = 640) and a 1024-hidden model's MLP. It prints the best
time of each instruction set, the first one's time over each other's, and whether the outputs
are bit-identical (they must be).

    python benchmarks/qgemm_isa.py [--isas avx2,avx512vnni] [--rows 1,8,32,128,512] [--reps 5]
                                   [--threads N]
    (--isas avx512vnni,amx on an AMX CPU: the tile unit against AVX512-VNNI)

On a shared 2-core VM, --threads 1: with 2, a call waits on whichever thread the other load
delays (times in steps of the 4 ms scheduler tick).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from qgemm_ab import call  # the engine's tm_qgemm call into a given copy of the kernel

from tokenmill.kernels import abi, cpu_library
from tokenmill.quant.packed import PackedWeight, pack_codes

# name -> (N, K); the head only up to HEAD_MAX_ROWS rows (one a sampling request)
SHAPES = {
    "270m gate_up": (2048, 640),
    "270m qkv": (1024, 640),
    "270m o/down": (640, 2048),
    "270m head": (262144, 640),
    "1024h gate_up": (7168, 1024),
    "1024h down": (1024, 7168),
}
HEAD_MAX_ROWS = 32


def random_weight(kind: str, n: int, k: int) -> PackedWeight:
    """A "q4" (float32 scales and offsets, G = 32) or "q8" (float16 scales) weight."""
    g = torch.Generator().manual_seed(n + k)
    if kind == "q4":
        codes = torch.randint(0, 16, (n, k), generator=g)
        scales = torch.rand(n, k // 32, generator=g) * 0.02
        offsets = torch.rand(n, k // 32, generator=g) * 0.1
        return PackedWeight("q4", pack_codes(codes, "q4"), scales, offsets, 32, (n, k))
    codes = torch.randint(-127, 128, (n, k), generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02).half()
    return PackedWeight("q8", pack_codes(codes, "q8"), scales, None, 32, (n, k))


def load(isa: str, tmp: Path) -> ctypes.CDLL:
    """A private copy of the built extension, its path chosen with TOKENMILL_ISA=isa."""
    lib = cpu_library.library()
    if lib is None:
        raise SystemExit("the C kernels are not built here")
    copy = tmp / f"qgemm_{isa}.so"
    shutil.copy(lib._name, copy)
    saved = os.environ.get("TOKENMILL_ISA")
    os.environ["TOKENMILL_ISA"] = isa
    try:
        dll = ctypes.CDLL(str(copy))
    finally:
        if saved is None:
            del os.environ["TOKENMILL_ISA"]
        else:
            os.environ["TOKENMILL_ISA"] = saved
    abi.bind(dll)
    if dll.tm_qgemm_isa().decode() != isa:
        raise SystemExit(f"this CPU does not run {isa} (runs {dll.tm_qgemm_isa().decode()})")
    return dll


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--isas", default="avx2,avx512vnni", help="the first is the baseline")
    parser.add_argument("--rows", default="1,8,32,128,512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES")
    parser.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: as set)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels share torch's OpenMP pool
    isas = args.isas.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {isa: load(isa, Path(tmp)) for isa in isas}
        head = f"{'weight':24s} {'rows':>5s} " + " ".join(f"{i + ' ms':>13s}" for i in isas)
        print(head + "".join(f" {isas[0] + '/' + i:>18s}" for i in isas[1:]) + "  equal")
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            for kind in ("q4", "q8"):
                w = random_weight(kind, n, k)
                act = 2 if kind == "q8" and name.endswith("head") else 1
                for rows in (int(r) for r in args.rows.split(",")):
                    if name.endswith("head") and rows > HEAD_MAX_ROWS:
                        continue
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                    ys = {isa: torch.empty(rows, n) for isa in isas}
                    best = dict.fromkeys(isas, float("inf"))
                    for _ in range(args.reps):
                        for isa in isas:
                            start = time.perf_counter()
                            call(libs[isa], x, w, act, ys[isa])
                            best[isa] = min(best[isa], time.perf_counter() - start)
                    equal = all(torch.equal(ys[isas[0]], ys[i]) for i in isas[1:])
                    label = f"{name} {kind}"
                    times = " ".join(f"{best[i] * 1e3:13.3f}" for i in isas)
                    ratios = "".join(f" {best[isas[0]] / best[i]:18.2f}" for i in isas[1:])
                    print(f"{label:24s} {rows:5d} {times}{ratios}  {equal}")
                    sys.stdout.flush()


if __name__ == "__main__":
    main()
