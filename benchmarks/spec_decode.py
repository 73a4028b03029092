"""Speculative decoding on gemma-3-270m: every method against no speculation, one process each.

(a) grounded: batch 1, the model is given a Python file and asked for it again (greedy, 256
    tokens); also llama.cpp's plain decode of the same prompt on the same GGUF, and the
    batch-1 bandwidth ceiling (bytes read per token / read bandwidth measured here);
(b) repeated: 20 requests of one kind (a record rewritten as JSON), one after another: mean
    decode tok/s over requests 2-20 against no speculation on the same requests;
(c) free: batch 1, open-ended prompts (256 tokens, greedy and sampled): speedup and acceptance;
(d) load: 16 and 32 concurrent requests (128-token random prompts, 128 tokens each): output
    tokens/s with each method enabled against none (speculative_max_batch as configured).

Each table row reports decode tokens/s (first token to last), the ratio to no speculation,
draft tokens kept / proposed, and the mean tokens a verifying step gave.

    python benchmarks/spec_decode.py [--tasks grounded repeated free free-sampled load]
                                     [--methods ngram suffix draft:6 draft:12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

ROOT = Path(__file__).parents[1]
THREADS = 2
OUTPUT_TOKENS = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS)
# Free generation sampled as chat apps do (seeded per prompt): greedy gemma-3-270m loops.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=OUTPUT_TOKENS)
FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List ten ideas for a weekend trip and say why each is fun.",
]
NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun"]
CITIES = ["Oslo", "Lima", "Pune", "Kyiv", "Doha", "Rome", "Nice", "Bern", "Oran", "Baku"]


def grounded_prompt() -> str:
    # A fixed copy (an early spec/ngram.py): the live file changes, and the task with it.
    code = (ROOT / "benchmarks/data/spec_grounded_input.py.txt").read_text()
    return f"Here is a Python file:\n\n{code}\n\nThe same file again, unchanged:\n\n"


def record_prompt(i: int) -> str:
    name, city, age = NAMES[i % 10], CITIES[(3 * i) % 10], 20 + (7 * i) % 50
    return (
        "Rewrite the record as JSON with the keys name, age, city and greeting (a one-line "
        f"hello in the city's language).\nRecord: {name}, {age} years, lives in {city}.\nJSON:"
    )


def engine_for(method: str | None, **kwargs) -> LLMEngine:
    """``method``: None, "ngram", "suffix" or "draft:N" (the target's first N layers); a
    "+eager" suffix runs every step eagerly (no decode graphs), "none+eager" too."""
    spec = {}
    if method is not None and method.endswith("+eager"):
        kwargs["enforce_eager"] = True
        method = method.removesuffix("+eager")
        method = None if method == "none" else method
    if method is not None and method.startswith("draft:"):
        spec = dict(speculative_method="draft", draft_num_layers=int(method.partition(":")[2]))
    elif method is not None:
        spec = dict(speculative_method=method)
    args = dict(max_model_len=4096, kv_cache_memory="512MiB", num_threads=THREADS)
    engine = LLMEngine(EngineArgs(**args, **spec, **kwargs))
    engine.add_request("warm up", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def decode_one(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[float, list[int]]:
    """Decode tok/s of one request alone (first token to last) and its tokens."""
    engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    assert out is not None
    m, tokens = out.metrics, out.outputs[0].token_ids
    return (len(tokens) - 1) / (m.finished_time - m.first_token_time), tokens


def spec_stats(engine: LLMEngine) -> dict:
    s = engine.stats().spec_decode
    return dict(
        drafted=s.num_draft_tokens,
        kept=s.num_accepted_tokens,
        mean_len=s.mean_accepted_len,
    )


def run_batch1(method: str | None, prompts: list[str], params: SamplingParams) -> dict:
    engine = engine_for(method)
    speeds, outputs = [], []
    for i, p in enumerate(prompts):
        seeded = params if params.is_greedy else dataclasses.replace(params, seed=i)
        speed, tokens = decode_one(engine, p, seeded)
        speeds.append(speed)
        outputs.append(tokens)
    return dict(
        speeds=speeds,
        outputs=outputs,
        weight_nbytes=engine.info.weight_nbytes,
        **spec_stats(engine),
    )


def run_load(method: str | None, num: int) -> dict:
    from tokenmill.bench.workload import random_prompts

    engine = engine_for(method, max_num_seqs=num)
    prompts = random_prompts(num, 128, engine.info.vocab_size, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens += len(o.outputs[0].token_ids)
    return dict(tok_s=tokens / (time.perf_counter() - start), **spec_stats(engine))


def run_llamacpp(prompt: str) -> dict:
    """llama.cpp's plain greedy decode of the prompt (its own kernels, 2 threads)."""
    from vs_llamacpp import _LlamaCpp

    from tokenmill.resolve import resolve_model
    from tokenmill.tokenizer import load_tokenizer

    source = resolve_model("gemma-3-270m")
    ids = load_tokenizer(source.path, "Gemma3ForCausalLM").encode(prompt)
    lc = _LlamaCpp(str(source.path), n_seq=1, n_ctx=4096, n_batch=1024)
    lc.generate([ids[:16]], 4)  # warm-up
    lc.clear()
    (tok,) = lc.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)])
    start = time.perf_counter()
    for step in range(OUTPUT_TOKENS - 1):
        (tok,) = lc.decode([(tok, len(ids) + step, 0, True)])
    return dict(tok_s=(OUTPUT_TOKENS - 1) / (time.perf_counter() - start))


def run_llama_lookup(prompt: str, num_draft: int) -> float | None:
    """llama.cpp's own prompt-lookup decoding (its llama-lookup example) on the same prompt:
    decode tok/s, or None when the binary is not built. Build it with the source of
    ../shared/peers/build-llamacpp.sh, cmake -DLLAMA_BUILD_EXAMPLES=ON, target llama-lookup,
    into $PEERS/build-lookup (PEERS defaults to ~/.cache/peers)."""
    import os
    import re
    import tempfile

    from tokenmill.resolve import resolve_model

    peers = Path(os.environ.get("PEERS", Path.home() / ".cache" / "peers"))
    binary = peers / "build-lookup" / "bin" / "llama-lookup"
    if not binary.exists():
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        proc = subprocess.run(
            [str(binary), "-m", str(resolve_model("gemma-3-270m").path), "-f", f.name,
             "-n", str(OUTPUT_TOKENS), "-t", str(THREADS), "--temp", "0", "-c", "4096",
             "--spec-draft-n-max", str(num_draft)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    found = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+)", proc.stderr)
    return float(found.group(1)) if found else None


def child(argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *argv], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(label: str, r: dict, base: float, speed: float, same: str = "-") -> str:
    kept = f"{r['kept']}/{r['drafted']}" if r.get("drafted") else "-"
    mean_len = f"{r['mean_len']:.2f}" if r.get("drafted") else "-"
    return f"| {label} | {speed:.1f} | {speed / base:.2f}x | {kept} | {mean_len} | {same} |"


HEADER = "| method | tok/s | vs none | drafts kept | tokens/verify | same output |\n|---|---|---|---|---|---|"


TASKS = {  # task -> (prompts, sampling, label)
    "grounded": (lambda: [grounded_prompt()], GREEDY, "(a) grounded, greedy"),
    "repeated": (lambda: [record_prompt(i) for i in range(20)], GREEDY, "(b) repeated, greedy"),
    "free": (lambda: FREE_PROMPTS, GREEDY, "(c) free, greedy"),
    "free-sampled": (lambda: FREE_PROMPTS, SAMPLED, "(c) free, temperature 0.8, top-p 0.95"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", nargs="+", default=[*TASKS, "load"])
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix", "draft:6", "draft:12"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # task method n
    ns = parser.parse_args()
    if ns.child:
        task, method, n = ns.child
        method = None if method == "none" else method
        if task == "llamacpp":
            print(json.dumps(run_llamacpp(grounded_prompt())))
        elif task == "load":
            print(json.dumps(run_load(method, int(n))))
        else:
            prompts, params, _ = TASKS[task]
            print(json.dumps(run_batch1(method, prompts(), params)))
        return
    print(
        f"{THREADS} threads; draft:N = the first N of gemma-3-270m's 18 layers, its norm and head"
    )
    print(f"median of {ns.rounds} rounds, each running every method in turn (this VM drifts)")
    for task in ns.tasks:
        if task == "load":
            for n in (16, 32):
                print(f"\n(d) {n} concurrent requests, output tok/s\n{HEADER}")
                runs = rounds(ns.rounds, ["none", *ns.methods], "load", str(n))
                base = median_speed(runs["none"])
                for m, rs in runs.items():
                    print(row(m, rs[0], base, median_speed(rs)), flush=True)
            continue
        _, params, label = TASKS[task]
        print(f"\n{label}, batch 1, decode tok/s\n{HEADER}")
        # Repeated: requests 2-20 (request 1 has no earlier answer to draw on).
        skip = 1 if task == "repeated" else 0
        runs = rounds(ns.rounds, ["none", *ns.methods], task, "0")
        base = median_speed(runs["none"], skip)
        for m, rs in runs.items():
            same = "-"
            if params.is_greedy and m != "none":
                same = "yes" if rs[0]["outputs"] == runs["none"][0]["outputs"] else "no"
            print(row(m, rs[0], base, median_speed(rs, skip), same), flush=True)
        if task == "grounded":
            lc = [child(["--child", "llamacpp", "none", "0"]) for _ in range(ns.rounds)]
            print(
                row("llama.cpp, no speculation", {}, base, median_speed(lc, lambda r: r["tok_s"]))
            )
            for k in (3, 8):
                lookup = [run_llama_lookup(grounded_prompt(), k) for _ in range(ns.rounds)]
                if None not in lookup:
                    label = f"llama.cpp llama-lookup, {k} drafts"
                    print(row(label, {}, base, statistics.median(lookup)))
            print(ceiling(runs["none"][0]["weight_nbytes"]))


def rounds(num: int, methods: list[str], task: str, n: str) -> dict[str, list[dict]]:
    """Each method's child run ``num`` times, the methods taking turns within a round."""
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(num):
        for m in methods:
            runs[m].append(child(["--child", task, m, n]))
    return runs


def median_speed(runs: list[dict], skip: int = 0) -> float:
    """The median over rounds of a run's tok/s (batch-1 runs: the mean over its requests,
    after the first ``skip``)."""
    return statistics.median(r["tok_s"] if "tok_s" in r else mean(r["speeds"][skip:]) for r in runs)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def ceiling(weight_nbytes: int) -> str:
    """Batch-1 decode can go no faster than reading every weight once per token."""
    from vs_llamacpp import read_bandwidth_gbs

    bw = read_bandwidth_gbs()
    limit = bw * 1e9 / weight_nbytes
    return (
        f"bandwidth ceiling: {weight_nbytes / 1e6:.0f} MB of weights a token at "
        f"{bw:.1f} GB/s read = {limit:.0f} tok/s (KV reads excluded: a higher bound)"
    )


if __name__ == "__main__":
    main()
