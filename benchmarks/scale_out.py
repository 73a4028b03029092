"""One replica against tensor parallelism (TP=2) and two data-parallel replicas behind the
router, on this machine, in one run (issue 25's closing figures).

Each configuration is a ``tokenmill serve`` started here and driven by ``tokenmill bench serve``
with the same requests (random token prompts, greedy, EOS ignored, all submitted at once after
a warm-up of the same shape):

    1 replica     tokenmill serve --num-threads T
    TP=2          tokenmill serve --tensor-parallel-size 2 --num-threads T/2 (each rank)
    DP=2          tokenmill serve --data-parallel-size 2 (this machine's threads split between them)

    python benchmarks/scale_out.py [--model gemma-3-270m] [--num-prompts 32]
        [--input-len 128] [--output-len 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import Skip, _free_port, _serve_and_bench  # noqa: E402

from tokenmill.bench.datasets import DatasetSpec, SampleRequest, sample_requests  # noqa: E402
from tokenmill.modelfile import summarize  # noqa: E402
from tokenmill.resolve import resolve_model  # noqa: E402
from tokenmill.tokenizer import load_tokenizer  # noqa: E402


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f" {f}" in flags]
    cpus = next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("CPU(s)")), "?"
    )
    return f"{name}, {' '.join(isa)}, {cpus} vCPUs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    path = resolve_model(args.model).path
    tokenizer = load_tokenizer(path, summarize(path).architecture)
    spec = DatasetSpec(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed,
    )  # fmt: skip

    def as_text(s: DatasetSpec) -> list[SampleRequest]:
        reqs = sample_requests(s, tokenizer, token_ids=True).requests
        return [SampleRequest(tokenizer.decode(r.prompt), r.prompt_len, r.output_len) for r in reqs]

    requests = as_text(spec)
    warmup = as_text(replace(spec, output_len=4, seed=args.seed + 1))
    tokenmill = shutil.which("tokenmill") or str(Path(sys.executable).parent / "tokenmill")
    half = max(1, args.threads // 2)
    configs = {
        "1 replica": ["--num-threads", str(args.threads)],
        "TP=2": ["--tensor-parallel-size", "2", "--num-threads", str(half)],
        # Unset, the launcher splits this machine's threads between the replicas (given, each
        # replica would take them all: 2 x T threads on T cores).
        "DP=2 (router)": ["--data-parallel-size", "2"],
    }
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} "
        f"output tokens, all at once; {args.threads} threads; {path.name}; CPU: {_cpu()}",
        flush=True,
    )
    runs: dict[str, dict] = {}
    for name, extra in configs.items():
        port = _free_port()
        cmd = [tokenmill, "--log-level", "warning", "serve", args.model, "--port", str(port),
               "--max-num-seqs", str(args.num_prompts), *extra]  # fmt: skip
        try:
            runs[name] = _serve_and_bench(cmd, port, requests, warmup)
        except Skip as e:
            print(f"{name}: skipped: {e}", flush=True)
            continue
        r = runs[name]
        print(f"{name}: {r['output_tok_s']:.1f} tok/s, TTFT {r['ttft_s'] * 1000:.0f} ms, "
              f"TPOT {r['tpot_s'] * 1000:.1f} ms", flush=True)  # fmt: skip
    base = runs.get("1 replica")
    print("\n| configuration | output tok/s | TTFT ms | TPOT ms | tok/s vs 1 replica |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else ""
        print(f"| {name} | {r['output_tok_s']:.1f} | {r['ttft_s'] * 1000:.0f} | "
              f"{r['tpot_s'] * 1000:.1f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
