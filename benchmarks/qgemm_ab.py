"""A change to the packed matmul (tokenmill/csrc/qgemm.c) against a baseline, in one process.

This machine's speed drifts by 10-50% from minute to minute (a shared VM), so two runs a minute
apart cannot tell a 5% kernel change from noise. Here both versions of the kernel are built
side by side (the baseline from a git revision, the candidate from the working tree), loaded
into one process, and called alternately on the same inputs: every timing pair sees the same
machine. For each of gemma-3-270m's packed weight layouts (and its output head, run as the
engine runs it) and each row count, it prints the median time of each and their ratio, and
the largest difference between their outputs, relative to the largest output (0 when the
change keeps the arithmetic). With the same code on both sides (an A/A run, 5 repetitions) the
ratios ranged 0.85-1.1: a change smaller than that needs more --reps, or several runs.

    python benchmarks/qgemm_ab.py [--base HEAD] [--rows 1,64,2048] [--reps 9] [--threads N]
        [--model FILE.gguf]  (repo root)

--threads 1 --rows 1 on a GGUF at real sizes (benchmarks/llama_shapes.py) times the batch-1
kernel's compute alone: each weight is called again and again, so it comes from the caches, not
memory (how the Q4_K / Q6_K loop was tuned: 1.06-1.13x, AMD EPYC Zen 4).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.kernels import abi, cpu_library
from tokenmill.layers.linear import FusedLinear, Linear
from tokenmill.quant.packed import PackedWeight

SOURCE = Path("tokenmill/csrc/qgemm.c")


def build(source: str, out_dir: Path, name: str) -> ctypes.CDLL:
    """qgemm.c alone as a shared library, with setup.py's flags."""
    src, lib = out_dir / f"{name}.c", out_dir / f"{name}.so"
    src.write_text(source)
    include = sysconfig.get_paths()["include"]
    headers = SOURCE.parent.resolve()  # simd.h and tokenmill.h, beside qgemm.c
    cmd = ["gcc", "-O3", "-fopenmp", "-fPIC", "-shared", f"-I{include}", f"-I{headers}", str(src)]
    cmd += ["-o", str(lib)]
    subprocess.run(cmd, check=True)
    dll = ctypes.CDLL(str(lib))
    abi.bind(dll, ["tm_qgemm"])
    return dll


def call(lib: ctypes.CDLL, x: torch.Tensor, w: PackedWeight, act: int, y: torch.Tensor) -> None:
    """The engine's call (cpu_library.qgemm) into a given build of the kernel."""
    offsets = w.offsets.data_ptr() if w.offsets is not None else None
    rc = lib.tm_qgemm(
        x.shape[0], w.shape[0], w.shape[1], x.data_ptr(), cpu_library.kind_code(w), w.codes.data_ptr(),
        w.scales.data_ptr(), offsets, w.group, None, y.data_ptr(), act,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("tm_qgemm could not allocate")


def layouts(engine: LLMEngine) -> dict[str, tuple[PackedWeight, int]]:
    """One weight per packed layout of the model, and the head: name -> (weight, act_int8)."""
    model = engine.executor.worker.model
    head = model.output_head()
    found: dict[str, tuple[PackedWeight, int]] = {}
    for name, m in model.named_modules():
        w = getattr(getattr(m, "quant_state", None), "weight", None)
        if isinstance(m, Linear) and m is not head and isinstance(w, PackedWeight):
            key = f"{name.split('.')[-1]} {w.kind} G{w.group} {tuple(w.shape)}"
            found.setdefault(key, (w, 1))
        for group in m.groups if isinstance(m, FusedLinear) else ():  # parts in one matmul
            if group.state is not None:
                w = group.state.weight
                key = f"{name.split('.')[-1]} {w.kind} G{w.group} {tuple(w.shape)}"
                found.setdefault(key, (w, 1))
    state = getattr(head, "quant_state", None)
    if isinstance(getattr(state, "weight", None), PackedWeight):
        name = f"output head {state.weight.kind} {tuple(state.weight.shape)}"
        found[name] = (state.weight, 2 if state.q8_unsigned else 1)
    if not found:
        raise SystemExit("the model holds no packed (GGUF) weights: nothing to compare")
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="git revision of the baseline kernel")
    parser.add_argument("--rows", default="1,64,2048")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: all)")
    args = parser.parse_args()
    base_src = subprocess.run(
        ["git", "show", f"{args.base}:{SOURCE}"], check=True, capture_output=True, text=True
    ).stdout
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=256, kv_cache_memory="64MiB"))
    if args.threads:  # after the engine, which sets its own: the kernel shares torch's pool
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = build(base_src, Path(tmp), "base")
        new = build(SOURCE.read_text(), Path(tmp), "new")
        print(
            f"{'weight':44s} {'rows':>5s} {'base ms':>9s} {'new ms':>9s} {'base/new':>8s}  max diff"
        )
        for name, (w, act) in layouts(engine).items():
            for rows in (int(r) for r in args.rows.split(",")):
                if name.startswith("output head") and rows > 64:
                    continue  # the head sees one row per sampling request: decode batches
                x = torch.randn(rows, w.shape[1])
                y_base, y_new = (torch.empty(rows, w.shape[0]) for _ in range(2))
                times: dict[str, list[float]] = {"base": [], "new": []}
                for _ in range(args.reps):
                    for label, lib, y in (("base", base, y_base), ("new", new, y_new)):
                        start = time.perf_counter()
                        call(lib, x, w, act, y)
                        times[label].append(time.perf_counter() - start)
                tb, tn = (statistics.median(times[k]) * 1e3 for k in ("base", "new"))
                diff = (y_base - y_new).abs().max().item() / max(y_base.abs().max().item(), 1e-30)
                print(f"{name:44s} {rows:5d} {tb:9.3f} {tn:9.3f} {tb / tn:8.3f}  {diff:.1e}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
