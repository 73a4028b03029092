"""Resident memory and start-up time of tokenmill against llama.cpp, same KV tokens and dtype.

For each side, ``--repeats`` fresh processes (never two at once):

- ``tokenmill serve`` with a float16 KV cache of exactly ``--ctx`` tokens (plus the null
  block), and llama-server ``-c CTX`` (f16 KV by default): seconds from spawn to /health 200,
  VmRSS then, and VmRSS after one 16-token completion;
- ``LLM("gemma-3-270m")`` in a fresh interpreter: seconds to ready (spawn to constructed, and
  the constructor alone);
- ``python -c "import torch"``'s VmRSS: the runtime's floor.

It prints medians side by side with the ratios, the CPU (lscpu model name and its avx2 /
avx512f / avx512_vnni flags), and tokenmill's startup "memory plan" line beside the RSS it
should add up to.

    .venv/bin/python benchmarks/memory_startup.py [--repeats 3] [--ctx 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# llama.cpp's tools: shared/peers/build-llamacpp.sh's folder, or $LLAMA_CPP_BIN (another build)
LLAMA_BIN = Path(
    os.environ.get("LLAMA_CPP_BIN", Path.home() / ".cache" / "peers" / "build-llamacpp" / "bin")
)
MODEL_ALIAS = "gemma-3-270m"
MODEL_FILE = Path.home() / ".cache" / "tokenmill" / "models" / "gemma-3-270m-q4_k_m.gguf"
# gemma-3-270m: 18 layers x 1 KV head x head_dim 256, K and V, float16.
KV_BYTES_PER_TOKEN = 18 * 1 * 256 * 2 * 2
BLOCK_SIZE = 16


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?")
    flags_line = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    flags = set(flags_line.split(":", 1)[-1].split())
    have = [f for f in ("avx2", "avx512f", "avx512_vnni") if f in flags]
    return f"{name}, {os.cpu_count()} CPUs, flags: {' '.join(have) or 'none of avx2/avx512'}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0, b""


def run_server(cmd: list[str], port: int, request: tuple[str, dict], env: dict) -> dict:
    """Spawn a server, time it to /health 200, read its RSS, send one request, read it again."""
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"{cmd[0]} exited {proc.returncode}:\n{log.read()[-3000:]}")
                status, _ = http(f"http://127.0.0.1:{port}/health", timeout=2.0)
                if status == 200:
                    break
                time.sleep(0.02)
            ready_s = time.perf_counter() - start
            time.sleep(0.3)  # a background thread may still be finishing (its pages count)
            rss_ready = vm_rss(proc.pid)
            path, body = request
            status, _ = http(f"http://127.0.0.1:{port}{path}", body, timeout=120.0)
            if status != 200:
                raise RuntimeError(f"{cmd[0]}: {path} answered {status}")
            rss_after = vm_rss(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
    plan = next((ln for ln in text.splitlines() if "memory plan:" in ln), None)
    loaded = next((ln for ln in text.splitlines() if "; tokenizer " in ln), None)
    tokenizer = None
    if loaded is not None:
        m = re.search(r"; tokenizer ([\d.]+) (B|KiB|MiB|GiB)", loaded)
        if m:
            tokenizer = float(m.group(1)) * _UNITS[m.group(2)]
    return dict(ready_s=ready_s, rss_ready=rss_ready, rss_after=rss_after, plan=plan,
                tokenizer_mib=tokenizer)  # fmt: skip


def tokenmill_cmd(port: int, ctx: int) -> list[str]:
    num_blocks = -(-ctx // BLOCK_SIZE) + 1  # the null block included
    kv_bytes = num_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    return [
        PYTHON, "-m", "tokenmill.cli", "serve", MODEL_ALIAS, "--port", str(port),
        "--kv-cache-dtype", "float16", "--kv-cache-memory", str(kv_bytes),
        "--max-model-len", str(ctx), "--num-threads", "2",
    ]  # fmt: skip


def llama_cmd(port: int, ctx: int) -> list[str]:
    return [
        str(LLAMA_BIN / "llama-server"), "-m", str(MODEL_FILE), "-c", str(ctx),
        "--port", str(port), "-t", "2",
    ]  # fmt: skip


_LLM_SCRIPT = """
import time, json, sys
t0 = time.perf_counter()
from tokenmill import LLM
t1 = time.perf_counter()
llm = LLM("gemma-3-270m", max_model_len={ctx})
t2 = time.perf_counter()
rss = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:")][0]
print("RESULT", json.dumps(dict(import_s=t1 - t0, construct_s=t2 - t1, rss=rss)))
"""


def run_llm(ctx: int, env: dict) -> dict:
    start = time.perf_counter()
    out = subprocess.run(
        [PYTHON, "-c", _LLM_SCRIPT.format(ctx=ctx)], capture_output=True, text=True, env=env
    )
    total = time.perf_counter() - start
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"LLM run failed:\n{out.stderr[-3000:]}")
    result = json.loads(line[len("RESULT ") :])
    result["ready_s"] = total
    return result


def torch_floor(env: dict) -> int:
    code = (
        "import torch\n"
        "print([int(l.split()[1]) * 1024 for l in open('/proc/self/status')"
        " if l.startswith('VmRSS:')][0])"
    )
    return int(subprocess.run([PYTHON, "-c", code], capture_output=True, text=True,
                              env=env, check=True).stdout.strip())  # fmt: skip


_UNITS = {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}


def parse_plan(line: str | None) -> dict[str, float]:
    """MiB of each term in the memory plan's log line ("weights 150.2 MiB, ...")."""
    if line is None:
        return {}
    units = _UNITS
    terms: dict[str, float] = {}
    body = line.split("memory plan:", 1)[1].split("(", 1)[0]
    for part in body.split(","):
        m = re.match(r"\s*([a-zA-Z ]+?)\s+([\d.]+)\s*(B|KiB|MiB|GiB)", part)
        if m:
            terms[m.group(1)] = float(m.group(2)) * units[m.group(3)]
    return terms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--skip-llm", action="store_true", help="leave out LLM() in-process")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")

    tm, lc, llm, floor = [], [], [], []
    for i in range(args.repeats):
        port = free_port()
        lc.append(run_server(llama_cmd(port, args.ctx), port,
                             ("/completion", {"prompt": "The capital of France is",
                                              "n_predict": 16}), env))  # fmt: skip
        port = free_port()
        tm.append(run_server(tokenmill_cmd(port, args.ctx), port,
                             ("/v1/completions", {"model": MODEL_ALIAS, "max_tokens": 16,
                                                  "prompt": "The capital of France is"}),
                             env))  # fmt: skip
        if not args.skip_llm:
            llm.append(run_llm(args.ctx, env))
        floor.append(torch_floor(env))
        print(f"repeat {i + 1}/{args.repeats}: tokenmill {tm[-1]['ready_s']:.2f} s "
              f"{tm[-1]['rss_ready'] / 2**20:.0f} MiB, llama.cpp {lc[-1]['ready_s']:.2f} s "
              f"{lc[-1]['rss_ready'] / 2**20:.0f} MiB", file=sys.stderr)  # fmt: skip

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    mib = 2**20
    rows = [
        ("ready (s): serve to /health 200", med(tm, "ready_s"), med(lc, "ready_s"), "s"),
        ("VmRSS when ready (MiB)", med(tm, "rss_ready") / mib, med(lc, "rss_ready") / mib, ""),
        ("VmRSS after 1 request (MiB)", med(tm, "rss_after") / mib, med(lc, "rss_after") / mib,
         ""),
    ]  # fmt: skip
    if llm:
        rows.append(("LLM() ready, spawn to built (s)", med(llm, "ready_s"), med(lc, "ready_s"),
                     "s"))  # fmt: skip
    print(f"CPU: {cpu_line()}   load: {Path('/proc/loadavg').read_text().split()[:3]}")
    print(f"KV: {args.ctx} tokens, float16, both sides; medians of {args.repeats}")
    print(f"{'':40} {'tokenmill':>10} {'llama.cpp':>10} {'ratio':>7}")
    for name, a, b, _ in rows:
        print(f"{name:40} {a:10.2f} {b:10.2f} {a / b:7.2f}")
    if llm:
        print(f"  LLM(): import {med(llm, 'import_s'):.2f} s, constructor "
              f"{med(llm, 'construct_s'):.2f} s, VmRSS {med(llm, 'rss') / mib:.0f} MiB")  # fmt: skip
    print(f"  python -c 'import torch' VmRSS: {statistics.median(floor) / mib:.0f} MiB")
    plan = tm[-1]["plan"]
    terms = parse_plan(plan)
    print(f"tokenmill's plan: {plan.split('memory plan:', 1)[1].strip() if plan else '(no line)'}")
    tokenizer = tm[-1]["tokenizer_mib"]
    if terms and tokenizer is not None:
        # The KV cache and step buffers are maps whose pages fill as they are written: resident
        # when ready is the other terms; with everything full, all of them.
        now = terms.get("runtime", 0) + terms.get("weights", 0) + tokenizer
        full = sum(terms.values()) + tokenizer
        rss = med(tm, "rss_ready") / mib
        after = med(tm, "rss_after") / mib
        print(f"  engine's tokenizer term: {tokenizer:.1f} MiB")
        print(f"  runtime + weights + tokenizer = {now:.1f} MiB vs VmRSS when ready {rss:.1f} MiB: "
              f"{(now - rss) / rss * 100:+.1f}%")  # fmt: skip
        print(f"  every term (KV cache and step buffers full) = {full:.1f} MiB; VmRSS after 1 "
              f"request {after:.1f} MiB")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(tokenmill=tm, llamacpp=lc, llm=llm, floor=floor)))


if __name__ == "__main__":
    main()
