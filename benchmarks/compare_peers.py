"""One workload on tokenmill and on every peer present on this machine, in one run, with ratios.

The workload: ``--num-prompts`` random prompts of ``--input-len`` tokens (the model's own
tokenizer, the same token ids everywhere), ``--output-len`` greedy tokens each (EOS ignored),
all submitted at once, ``--threads`` CPU threads per engine. Each engine runs alone, one after
the other:

    tokenmill (engine)    in process, as ``tokenmill bench throughput`` times it (bench/cli.py)
    tokenmill (server)    ``tokenmill serve`` started here, driven by ``tokenmill bench serve``
    transformers          ``model.generate`` on the whole batch (a GGUF is loaded with
                          ``gguf_file=`` and dequantized to float32 by transformers)
    llama-cpp-python      llama.cpp's C API, all sequences in one batch a step
                          (benchmarks/vs_llamacpp.py's driver)
    llama-server          llama.cpp's server (~/.cache/peers/build-llamacpp/bin/llama-server or
                          $LLAMA_CPP_BIN) started here, driven by ``tokenmill bench serve``

A peer that is not installed or cannot load the model is skipped with the reason. Figures:
output tokens/s (all requests), mean TTFT and mean TPOT; ratios are tokenmill / peer, the
in-process tokenmill against in-process peers, the tokenmill server against llama-server
(over tok/s: > 1 is tokenmill faster; for TTFT and TPOT: < 1 is tokenmill faster).

    python benchmarks/compare_peers.py [--model gemma-3-270m|FILE.gguf|HF_DIR]
        [--num-prompts 16] [--input-len 128] [--output-len 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx

from tokenmill.bench.datasets import Dataset, DatasetSpec, SampleRequest, sample_requests
from tokenmill.bench.metrics import calculate_metrics
from tokenmill.bench.serve import ServeConfig, run_serve_benchmark
from tokenmill.modelfile import summarize
from tokenmill.resolve import resolve_model
from tokenmill.tokenizer import load_tokenizer

LLAMA_SERVER = Path.home() / ".cache/peers/build-llamacpp/bin/llama-server"


class Skip(Exception):
    """A peer that cannot run here; the message says why."""


def _figures(output_tok_s: float, ttft_s: float, tpot_s: float) -> dict:
    return {"output_tok_s": output_tok_s, "ttft_s": ttft_s, "tpot_s": tpot_s}


def _from_metrics(results, duration_s: float) -> dict:
    m = calculate_metrics(results, duration_s)
    if m.failed:
        raise Skip(f"{m.failed} requests failed: {next(iter(m.errors))}")
    return _figures(m.output_throughput, m.ttft_ms.mean / 1000, m.tpot_ms.mean / 1000)


def run_tokenmill_engine(args, requests: list[SampleRequest], warmup: list[SampleRequest]) -> dict:
    from tokenmill.bench.cli import run_timed
    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(model=args.model, num_threads=args.threads, max_num_seqs=len(requests))
    )
    run_timed(engine, Dataset(warmup, "tokens"), time.perf_counter())
    start = time.perf_counter()
    results = run_timed(engine, Dataset(requests, "tokens"), start)
    out = _from_metrics(results, time.perf_counter() - start)
    del engine
    gc.collect()
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_and_bench(
    cmd: list[str], port: int, requests: list[SampleRequest], warmup: list[SampleRequest]
) -> dict:
    """Start a server, wait for /health, run bench serve on the warm-up then the timed
    prompts, stop it."""
    log = open(f"/tmp/compare_peers_{Path(cmd[0]).name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise Skip(f"{Path(cmd[0]).name} exited with {proc.returncode} ({log.name})")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise Skip(f"{Path(cmd[0]).name} did not become ready ({log.name})")
            time.sleep(0.5)
        cfg = ServeConfig(url, progress=False)
        run_serve_benchmark(cfg, Dataset(warmup, "tokens"))
        outcome = run_serve_benchmark(cfg, Dataset(requests, "tokens"))
        return _from_metrics(outcome.results, outcome.duration_s)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_tokenmill_server(args, requests: list[SampleRequest], warmup: list[SampleRequest]) -> dict:
    port = _free_port()
    tokenmill = shutil.which("tokenmill") or str(Path(sys.executable).parent / "tokenmill")
    cmd = [tokenmill, "--log-level", "warning", "serve", args.model, "--port", str(port),
           "--num-threads", str(args.threads), "--max-num-seqs", str(len(requests))]  # fmt: skip
    return _serve_and_bench(cmd, port, requests, warmup)


def run_llama_server(
    args, requests: list[SampleRequest], warmup: list[SampleRequest], gguf: Path | None
) -> dict:
    binary = Path(os.environ.get("LLAMA_CPP_BIN", LLAMA_SERVER))
    if binary.is_dir():
        binary = binary / "llama-server"
    if not binary.exists():
        raise Skip(f"no llama-server at {binary} (build llama.cpp or set $LLAMA_CPP_BIN)")
    if gguf is None:
        raise Skip("the model is not a GGUF file")
    port = _free_port()
    per_seq = args.input_len + args.output_len + 64
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(len(requests)),
           "-c", str(per_seq * len(requests))]  # fmt: skip
    return _serve_and_bench(cmd, port, requests, warmup)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a while (C libraries write there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def run_transformers(
    args, token_prompts: list[list[int]], warmup: list[list[int]], path: Path
) -> dict:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise Skip(f"transformers is not installed ({e})") from None
    torch.set_num_threads(args.threads)
    try:
        if path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
    except Exception as e:  # noqa: BLE001 - any load failure means "skip this peer"
        raise Skip(f"transformers cannot load {path.name}: {str(e).splitlines()[0]}") from None
    model.eval()

    def generate(prompts: list[list[int]], max_new: int) -> float:
        ids = torch.tensor(prompts)
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                min_new_tokens=max_new, do_sample=False, pad_token_id=0,
            )  # fmt: skip
            return time.perf_counter() - start

    generate(warmup, 4)
    ttft = generate(token_prompts, 1)  # the whole batch has its first token after prefill
    total = generate(token_prompts, args.output_len)
    tpot = (total - ttft) / (args.output_len - 1)
    return _figures(len(token_prompts) * args.output_len / total, ttft, tpot)


def run_llama_cpp_python(
    args, token_prompts: list[list[int]], warmup: list[list[int]], gguf: Path | None
) -> dict:
    if gguf is None:
        raise Skip("the model is not a GGUF file")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise Skip("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
    import vs_llamacpp

    vs_llamacpp.THREADS = args.threads  # read by _LlamaCpp when it builds its context
    n = len(token_prompts)
    per_seq = args.input_len + args.output_len + 32
    with _quiet_stderr():  # llama.cpp logs every tensor as it loads
        lc = vs_llamacpp._LlamaCpp(str(gguf), n_seq=n, n_ctx=n * per_seq, n_batch=512)
    lc.generate(warmup, 4)
    lc.clear()
    start = time.perf_counter()
    items = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(token_prompts)
             for pos, t in enumerate(p)]  # fmt: skip
    tokens = lc.decode(items)
    ttft = time.perf_counter() - start
    for step in range(args.output_len - 1):
        tokens = lc.decode(
            [(tokens[s], len(p) + step, s, True) for s, p in enumerate(token_prompts)]
        )
    total = time.perf_counter() - start
    tpot = (total - ttft) / (args.output_len - 1)
    return _figures(n * args.output_len / total, ttft, tpot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m", help="alias, .gguf or HF dir")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (TPOT needs two tokens)")

    path = resolve_model(args.model).path
    gguf = path if path.suffix == ".gguf" else None
    tokenizer = load_tokenizer(path, summarize(path).architecture)
    spec = DatasetSpec(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed,
    )  # fmt: skip
    token_requests = sample_requests(spec, tokenizer, token_ids=True).requests
    token_prompts = [list(r.prompt) for r in token_requests]
    # Warm-up: other prompts of the workload's shape and batch size, 4 tokens each (the first
    # steps of a batch size record graphs or allocate; other prompts: no prefix-cache hit).
    other = replace(spec, output_len=4, seed=args.seed + 1)
    token_warmup = sample_requests(other, tokenizer, token_ids=True).requests
    warm_prompts = [list(r.prompt) for r in token_warmup]

    def as_text(reqs: list[SampleRequest]) -> list[SampleRequest]:
        # The servers get the same ids as text (decoded; the server re-encodes it).
        return [SampleRequest(tokenizer.decode(r.prompt), r.prompt_len, r.output_len) for r in reqs]

    text_requests, text_warmup = as_text(token_requests), as_text(token_warmup)
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} "
        f"output tokens each, all at once, {args.threads} threads; model {path.name}",
        flush=True,
    )
    runs: dict[str, dict] = {}
    for name, run in (
        ("tokenmill (engine)", lambda: run_tokenmill_engine(args, token_requests, token_warmup)),
        ("transformers", lambda: run_transformers(args, token_prompts, warm_prompts, path)),
        ("llama-cpp-python", lambda: run_llama_cpp_python(args, token_prompts, warm_prompts, gguf)),
        ("tokenmill (server)", lambda: run_tokenmill_server(args, text_requests, text_warmup)),
        ("llama-server", lambda: run_llama_server(args, text_requests, text_warmup, gguf)),
    ):
        try:
            runs[name] = run()
        except Skip as e:
            print(f"{name}: skipped: {e}", flush=True)
            continue
        r = runs[name]
        print(
            f"{name}: {r['output_tok_s']:.1f} output tok/s, TTFT {r['ttft_s'] * 1000:.0f} ms, "
            f"TPOT {r['tpot_s'] * 1000:.1f} ms",
            flush=True,
        )
    print("\n| engine | output tok/s | TTFT ms | TPOT ms | tok/s ratio | TTFT ratio | TPOT ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        base = runs.get("tokenmill (server)" if name == "llama-server" else "tokenmill (engine)")
        cells = ["", "", ""]
        if base is not None and not name.startswith("tokenmill"):
            cells = [
                f"{base['output_tok_s'] / r['output_tok_s']:.2f}x",
                f"{base['ttft_s'] / r['ttft_s']:.2f}x",
                f"{base['tpot_s'] / r['tpot_s']:.2f}x",
            ]
        print(
            f"| {name} | {r['output_tok_s']:.1f} | {r['ttft_s'] * 1000:.0f} | "
            f"{r['tpot_s'] * 1000:.1f} | {' | '.join(cells)} |"
        )
    print("(ratios: tokenmill / peer; the server row against tokenmill (server))")


if __name__ == "__main__":
    main()
