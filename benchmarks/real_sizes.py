"""tokenmill beside llama.cpp on GGUFs at real sizes (benchmarks/llama_shapes.py), alternating.

For each file, ``--rounds`` times, tokenmill then llama.cpp (llama.cpp's own llama-bench, from
../shared/peers/build-llamacpp.sh), each in its own process, 2 threads:
  - batch-1 decode tokens/s (64 tokens after a 16-token prompt), beside the read-bandwidth
    ceiling: the weights' bytes read a token (the file's tensors, a mixture's experts in the
    share a token runs) over a read-bandwidth probe taken just before (vs_llamacpp's: the best
    of 5 sums of 1 GiB of float32, 2 threads), and the share of that ceiling each engine
    reaches;
  - prefill tokens/s of a 512-token prompt;
  - output tokens/s of 32 requests of 128 + 128 tokens at once, prefill included (llama.cpp:
    llama-batched-bench, 32 sequences in one batch);
  - a load: seconds and peak RSS (tokenmill: ``LLM(file)`` in a fresh process, with the
    packed-model cache off, as a first load, and RSS once loaded; llama.cpp: llama-bench of
    one token, whole process).
Prints one table a file: the median of each figure over the rounds, and tokenmill / llama.cpp.

    python benchmarks/real_sizes.py FILE.gguf [FILE.gguf ...] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from memory_startup import LLAMA_BIN, cpu_line
from vs_llamacpp import read_bandwidth_gbs

LLAMA_BENCH = LLAMA_BIN / "llama-bench"
LLAMA_BATCHED = LLAMA_BENCH.with_name("llama-batched-bench")
THREADS = 2
CONCURRENT = 32  # requests of 128 + 128 tokens at once (--concurrent 0: skip)

# A first load in a fresh process: its seconds, peak RSS and RSS once loaded.
_LOAD = """
import json, sys, time
t = time.perf_counter()
from tokenmill import LLM
llm = LLM(sys.argv[1], max_model_len=2048)
seconds = time.perf_counter() - t
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
kib = lambda key: int(status[key].split()[0]) * 1024
print(json.dumps({"load_s": seconds, "peak_rss": kib("VmHWM"), "rss": kib("VmRSS")}))
"""


def _tokenmill(*args: str, env: dict | None = None) -> str:
    cmd = [sys.executable, "-c", "from tokenmill.cli import main; main()", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {out.stderr[-2000:]}")
    return out.stdout


def tokenmill_speed(path: Path, concurrent: int) -> dict[str, float]:
    common = ["bench", "latency", str(path), "--max-model-len", "2048", "--json"]
    decode = json.loads(_tokenmill(*common, "--input-len", "16", "--output-len", "64",
                                   "--num-iters", "3").splitlines()[-1])  # fmt: skip
    prefill = json.loads(_tokenmill(*common, "--input-len", "512", "--output-len", "1",
                                    "--num-iters", "2").splitlines()[-1])  # fmt: skip
    figures = {"decode": decode["decode_tokens_per_s_median"],
               "prefill": prefill["prefill_tokens_per_s"]}  # fmt: skip
    if concurrent:
        batch = json.loads(_tokenmill("bench", "throughput", str(path), "--max-model-len", "2048",
                                      "--num-prompts", str(concurrent), "--input-len", "128",
                                      "--output-len", "128", "--json").splitlines()[-1])  # fmt: skip
        figures["concurrent"] = batch["output_tokens_per_s"]
    return figures


def tokenmill_load(path: Path) -> dict[str, float]:
    env = {**os.environ, "TOKENMILL_NO_CACHE": "1"}
    cmd = [sys.executable, "-c", _LOAD, str(path)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])


def _llama_bench(path: Path, *args: str) -> tuple[list[dict], float, int]:
    """llama-bench's JSON results, the process's seconds and peak RSS (bytes)."""
    cmd = [str(LLAMA_BENCH), "-m", str(path), "-t", str(THREADS), "-o", "json", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise RuntimeError(f"llama-bench failed: {cmd}")
    return json.loads(out), time.perf_counter() - start, usage.ru_maxrss * 1024


def llama_speed(path: Path, concurrent: int) -> dict[str, float]:
    decode, _, _ = _llama_bench(path, "-p", "0", "-n", "64", "-r", "3")
    prefill, _, _ = _llama_bench(path, "-p", "512", "-n", "0", "-r", "2")
    figures = {"decode": decode[0]["avg_ts"], "prefill": prefill[0]["avg_ts"]}
    if concurrent:  # output tokens over the whole run, prefill included, as tokenmill's
        cmd = [str(LLAMA_BATCHED), "-m", str(path), "-t", str(THREADS), "-c", "16384", "-b",
               "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", str(concurrent),
               "--output-format", "jsonl"]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        figures["concurrent"] = concurrent * 128 / row["t"]
    return figures


def llama_load(path: Path) -> dict[str, float]:
    _, seconds, peak = _llama_bench(path, "-p", "0", "-n", "1", "-r", "1")
    return {"load_s": seconds, "peak_rss": peak}


def weight_bytes(path: Path) -> int:
    """Bytes a decode step reads: every tensor, a mixture of experts' stacked experts
    (``*_exps``) in the share a token runs (expert_used_count of expert_count)."""
    from tokenmill.modelfile import read_gguf

    header = read_gguf(path)
    arch = header.metadata.get("general.architecture")
    used = header.metadata.get(f"{arch}.expert_used_count") or 1
    count = header.metadata.get(f"{arch}.expert_count") or 1
    return int(sum(t.num_bytes * (used / count if "_exps." in t.name else 1)
                   for t in header.tensors))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrent", type=int, default=CONCURRENT)
    args = parser.parse_args()
    if not LLAMA_BENCH.exists():
        sys.exit(f"{LLAMA_BENCH} is missing: run ../shared/peers/build-llamacpp.sh")
    print(cpu_line())
    for path in args.files:
        rows: dict[str, dict[str, list[float]]] = {"tokenmill": {}, "llama.cpp": {}}
        bandwidths = []
        for _ in range(args.rounds):
            for name, speed, load in (
                ("tokenmill", tokenmill_speed, tokenmill_load),
                ("llama.cpp", llama_speed, llama_load),
            ):
                bandwidths.append(read_bandwidth_gbs() * 1e9)
                figures = {**speed(path, args.concurrent), **load(path)}
                for key, value in figures.items():
                    rows[name].setdefault(key, []).append(value)
        med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
        bw, nbytes = statistics.median(bandwidths), weight_bytes(path)
        ceiling = bw / nbytes
        tm, lc = med["tokenmill"], med["llama.cpp"]
        print(f"\n{path.name}: weights {nbytes / 1e9:.3f} GB, read bandwidth {bw / 1e9:.1f} GB/s "
              f"(probe), decode ceiling {ceiling:.1f} tok/s, {args.rounds} rounds")  # fmt: skip
        print("| | tokenmill | llama.cpp | ratio |\n|---|---|---|---|")
        print(f"| batch-1 decode, tok/s | {tm['decode']:.2f} ({tm['decode'] / ceiling:.0%} of "
              f"ceiling) | {lc['decode']:.2f} ({lc['decode'] / ceiling:.0%}) | "
              f"{tm['decode'] / lc['decode']:.2f}x |")  # fmt: skip
        print(f"| prefill 512, tok/s | {tm['prefill']:.1f} | {lc['prefill']:.1f} | "
              f"{tm['prefill'] / lc['prefill']:.2f}x |")  # fmt: skip
        if "concurrent" in tm:
            print(f"| {args.concurrent} concurrent 128/128, output tok/s incl. prefill | "
                  f"{tm['concurrent']:.1f} | {lc['concurrent']:.1f} | "
                  f"{tm['concurrent'] / lc['concurrent']:.2f}x |")  # fmt: skip
        print(f"| load, s | {tm['load_s']:.2f} | {lc['load_s']:.2f} (incl. a token) | "
              f"{tm['load_s'] / lc['load_s']:.2f}x |")  # fmt: skip
        print(f"| load peak RSS, GB | {tm['peak_rss'] / 1e9:.2f} (loaded: {tm['rss'] / 1e9:.2f}) "
              f"| {lc['peak_rss'] / 1e9:.2f} | {tm['peak_rss'] / lc['peak_rss']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
