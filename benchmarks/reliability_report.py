"""The reliability figures of issue 26 in one run, printed as its closing table: load held
(clients, requests, duration, failures), faults injected and survived (by kind), fuzz cases
run and 5xx found, memory growth (RSS after the warm-up vs at the end), KV blocks leaked, p99
TTFT.

One server on loopback, in this process (its RSS is this process's: the server's and the
load clients', as in test_load.py), runs the suites' measurable parts in turn with the helpers
of tests/reliability: the load of test_load.py; rounds of the faults of test_faults.py among
bystanders (clients gone before their request is read, before the first token, mid-stream, at
the last chunk; a non-streamed client that times out; requests failing inside the engine
through the fault hook, streamed and not); schemathesis over /openapi.json as
test_fuzz_openapi.py runs it (the server has no keys, so that the raw-socket clients reach the
engine; the tests fuzz a server with keys). Not here: queue overflow and preemption storms
(they need a differently sized server; tests/reliability/test_faults.py has them) and shutdown
(tests/reliability/test_shutdown.py).

    python benchmarks/reliability_report.py                  # tiny random-weight Llama
    python benchmarks/reliability_report.py --clients 32 --duration 30
    python benchmarks/reliability_report.py --model gemma-3-270m --clients 256 --duration 600

Exit status 1 when a figure that must be 0 (failures, faults not survived, 5xx, blocks
leaked) is not, or the load's memory grew by more than 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(ROOT / "tests"),
    str(ROOT / "tests" / "server"),
    str(ROOT / "tests" / "reliability"),
]

from live_server import LiveServer, tiny_engine_args  # noqa: E402
from test_faults import (  # noqa: E402
    BYSTANDERS,
    LAST_CHUNK,
    NUM_TOKENS,
    _body,
    _send_and_close,
    _stream,
)
from test_fuzz_openapi import run_fuzz  # noqa: E402
from test_load import measure_load, rss_bytes  # noqa: E402

from tokenmill.config import EngineArgs  # noqa: E402
from tokenmill.engine.async_engine import AsyncEngine  # noqa: E402

SERVED = "reliability"
FAULT_KINDS = (
    "gone before the request is read",
    "left before the first token",
    "left mid-stream",
    "left at the last chunk",
    "non-streamed client timed out",
    "engine fault, streamed",
    "engine fault, non-streamed",
)


def tiny_model(directory: Path) -> Path:
    """The tests' tiny random-weight Llama (tests/conftest.py's config and tokenizer)."""
    import conftest
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = conftest._tiny_hf_config("llama")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    conftest._write_byte_tokenizer(directory, config.vocab_size)
    return directory


def engine_args(model: str, num_clients: int, directory: Path) -> EngineArgs:
    if model == "tiny":
        kv = "32MiB" if num_clients > 64 else "16MiB"
        return tiny_engine_args(tiny_model(directory), max_num_seqs=num_clients, kv_cache_memory=kv)
    return EngineArgs(
        model=model, max_model_len=512, kv_cache_memory="512MiB", max_num_seqs=num_clients
    )


def blocks_held(server: LiveServer, timeout: float = 30.0) -> int:
    """KV blocks still held once the engine is idle (waits up to ``timeout`` for it)."""
    llm = server.engine.engine
    with contextlib.suppress(AssertionError):
        server.wait_idle(timeout)
    return llm.num_total_blocks - llm.num_free_blocks


# ---- faults ------------------------------------------------------------------------------------


@dataclass
class FaultTally:
    injected: Counter[str] = field(default_factory=Counter)
    survived: Counter[str] = field(default_factory=Counter)
    bystanders: int = 0
    bystanders_exact: int = 0

    def count(self, kind: str, ok: bool) -> None:
        self.injected[kind] += 1
        self.survived[kind] += ok


def _req(body: dict[str, Any]) -> dict[str, Any]:
    return body | {"model": SERVED}


def _fault_hook(llm) -> Any:
    """Slows the leavers' steps (so they leave before their end on a fast machine) and fails
    a VICTIM's sequences after their third token, as test_faults.py does."""
    marked: dict[str, str] = {}

    def hook(seq_id: str) -> None:
        req = llm.scheduler.requests.get(seq_id)
        if seq_id not in marked:
            text = llm.tokenizer.decode(req.prompt_token_ids) if req is not None else ""
            marked[seq_id] = next(
                (m for m in ("VICTIM", "leaver", "gone", "slow") if m in text), ""
            )
        mark = marked[seq_id]
        if mark == "VICTIM" and req is not None and req.num_output_tokens >= 3:
            raise RuntimeError("injected fault")
        if mark in ("leaver", "gone", "slow"):
            time.sleep(0.002)

    return hook


async def _fault_round(
    url: str, rng: random.Random, idx: int
) -> tuple[list[dict], dict[str, list]]:
    leave_points = [0, 0, 1, rng.randint(2, NUM_TOKENS), LAST_CHUNK]
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        loop = asyncio.get_running_loop()
        gone = [
            loop.run_in_executor(None, _send_and_close, url, _req(_body(f"gone {idx}.{i}", 200)))
            for i in range(2)
        ]
        leavers = [
            _stream(
                client, _req(_body(f"leaver {idx}.{i}", NUM_TOKENS if n == LAST_CHUNK else 200)), n
            )
            for i, n in enumerate(leave_points)
        ]
        victims = [
            _stream(client, _req(_body(f"VICTIM streamed {idx}", 40))),
            client.post("/v1/completions", json=_req(_body(f"VICTIM plain {idx}", 40, False))),
        ]

        async def timed_out() -> bool:
            try:
                await client.post(
                    "/v1/completions", json=_req(_body(f"slow {idx}", 230, False)), timeout=0.3
                )
            except httpx.ReadTimeout:
                return True
            return False

        bystanders = [_stream(client, _req(_body(p))) for p in BYSTANDERS]
        results = await asyncio.gather(*bystanders, *leavers, *victims, timed_out(), *gone)
    n = len(BYSTANDERS)
    return results[:n], {
        "leavers": list(zip(leave_points, results[n : n + len(leavers)], strict=True)),
        "victims": results[n + len(leavers) : n + len(leavers) + 2],
        "timed_out": [results[n + len(leavers) + 2]],
        "gone": [None] * len(gone),
    }


def run_faults(server: LiveServer, num_rounds: int) -> FaultTally:
    """``num_rounds`` rounds of every fault kind among the bystanders; a fault survived when
    the request got what it should (an abort, an error chunk then [DONE], a 500) and the
    server stayed healthy; a bystander is exact when its greedy text equals its run alone."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        baseline = []
        for prompt in BYSTANDERS:
            r = client.post("/v1/completions", json=_req(_body(prompt, stream=False)))
            baseline.append(r.json()["choices"][0]["text"])
    llm = server.engine.engine
    tally = FaultTally()
    rng = random.Random(26)
    llm.fault_hook = _fault_hook(llm)
    try:
        for idx in range(num_rounds):
            bystanders, faults = asyncio.run(_fault_round(server.url, rng, idx))
            server.wait_idle(timeout=60)
            healthy = httpx.get(f"{server.url}/health").status_code == 200
            for got, want in zip(bystanders, baseline, strict=True):
                tally.bystanders += 1
                tally.bystanders_exact += (
                    got["status"] == 200 and got["done"] and got["error"] is None
                    and got["text"] == want
                )  # fmt: skip
            for point, seen in faults["leavers"]:
                kind = {0: FAULT_KINDS[1], LAST_CHUNK: FAULT_KINDS[3]}.get(point, FAULT_KINDS[2])
                tally.count(kind, healthy and seen["status"] == 200 and not seen["done"])
            for _ in faults["gone"]:
                tally.count(FAULT_KINDS[0], healthy)
            for ok in faults["timed_out"]:
                tally.count(FAULT_KINDS[4], healthy and ok)
            streamed, plain = faults["victims"]
            tally.count(
                FAULT_KINDS[5],
                healthy
                and streamed["done"]
                and (streamed["error"] or {}).get("code") == "engine_error",
            )
            tally.count(
                FAULT_KINDS[6],
                healthy
                and plain.status_code == 500
                and plain.json()["error"]["code"] == "engine_error",
            )
    finally:
        llm.fault_hook = None
    return tally


# ---- the report ----------------------------------------------------------------------------------


def _progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny (default) or a model tokenmill loads (gemma-3-270m)"
    )
    parser.add_argument(
        "--clients", type=int, default=64, help="concurrent streaming clients (default: 64)"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds of load after the warm-up (default: 60)",
    )
    parser.add_argument(
        "--fault-rounds",
        type=int,
        default=None,
        help="fault rounds (default: 1 per 30 s of --duration, at least 2)",
    )
    parser.add_argument(
        "--fuzz-examples",
        type=int,
        default=None,
        help="schemathesis cases per operation (default: 30; 300 from --duration 300)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="keep the server's logs of the injected faults"
    )
    ns = parser.parse_args(argv)
    if not ns.verbose:  # the faults and the fuzzing are logged as they are meant to be
        logging.getLogger("tokenmill").setLevel(logging.CRITICAL)
    fault_rounds = ns.fault_rounds or max(2, int(ns.duration // 30))
    fuzz_examples = ns.fuzz_examples or (300 if ns.duration >= 300 else 30)

    with tempfile.TemporaryDirectory() as tmp:
        args = engine_args(ns.model, ns.clients, Path(tmp) / "model")
        server = LiveServer(
            lambda: AsyncEngine.from_args(args), served_model_name=SERVED, max_queue=None
        )
        server.start(timeout=600)
        started = time.monotonic()
        try:
            # The tiny model is float (exact greedy text under load); a GGUF's packed weights
            # run int8 activations, where a split prefill can flip a near-tie: counted.
            load = measure_load(
                server, SERVED, ns.clients, ns.duration, exact_greedy=ns.model == "tiny"
            )
            # Each part's figures as it ends (stderr): a long soak stopped later keeps them.
            _progress(
                f"load: {load.num_requests} requests, {len(load.failures)} failures, p99 TTFT "
                f"{load.ttft_percentile(99) * 1000:.0f} ms, RSS {load.rss_warm / 2**20:.0f} -> "
                f"{load.rss_end / 2**20:.0f} MiB"
            )
            faults = run_faults(server, fault_rounds)
            _progress(
                f"faults: {sum(faults.survived.values())} of {sum(faults.injected.values())} "
                f"survived, bystanders exact {faults.bystanders_exact}/{faults.bystanders}"
            )
            fuzz = run_fuzz(server.url, "unused", fuzz_examples, Path(tmp), timeout=3600)
            _progress(f"fuzz: {fuzz.num_cases} cases, {len(fuzz.server_errors)} 5xx")
            leaked = blocks_held(server)
            rss_end = rss_bytes()
        finally:
            server.stop()
        total_s = time.monotonic() - started

    # The figure is the load's (RSS once idle after it vs after its warm-up); the
    # faults and the fuzzing then take code paths the warm-up did not (tools, grammars, ...),
    # so the end of the run is shown beside it, not held to the 10%.
    growth = load.rss_end / load.rss_warm - 1
    growth_end = rss_end / load.rss_warm - 1
    survived = sum(faults.survived.values())
    injected = sum(faults.injected.values())
    kinds = "; ".join(f"{k} {faults.survived[k]}/{faults.injected[k]}" for k in FAULT_KINDS)
    rows = [
        ("load held", f"{load.num_clients} clients, {load.num_requests} requests, "
                      f"{load.duration_s:.0f} s, {len(load.failures)} failures; greedy stop "
                      f"jobs with another text than alone: {len(load.inexact)} of "
                      f"{load.stop_jobs}"),
        ("faults injected / survived", f"{injected} / {survived} ({kinds}); bystanders exact "
                                       f"{faults.bystanders_exact}/{faults.bystanders}"),
        ("fuzz cases run / 5xx", f"{fuzz.num_cases} cases over {fuzz.num_operations} operations "
                                 f"({fuzz.num_responses} answers), {len(fuzz.server_errors)} 5xx, "
                                 f"schemathesis exit {fuzz.returncode}"),
        ("memory growth", f"RSS {load.rss_warm / 2**20:.0f} MiB after warm-up -> "
                          f"{load.rss_end / 2**20:.0f} MiB after the load ({growth:+.1%}); "
                          f"{rss_end / 2**20:.0f} MiB after faults and fuzzing "
                          f"({growth_end:+.1%})"),
        ("blocks leaked", f"{leaked}"),
        ("p99 TTFT", f"{load.ttft_percentile(99) * 1000:.0f} ms (p50 "
                     f"{load.ttft_percentile(50) * 1000:.0f} ms, {len(load.ttfts)} requests)"),
    ]  # fmt: skip
    print(f"\nreliability report: model {ns.model}, {total_s:.0f} s in all\n")
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for failure in load.failures[:5]:
        print(f"load failure: {failure!r}", file=sys.stderr)
    for error in fuzz.server_errors[:5]:
        print(f"5xx: {error}", file=sys.stderr)
    if fuzz.returncode != 0:
        print(fuzz.output[-4000:], file=sys.stderr)
    ok = (
        not load.failures
        and survived == injected
        and faults.bystanders_exact == faults.bystanders
        and not fuzz.server_errors
        and fuzz.returncode == 0
        and leaked == 0
        and growth <= 0.10
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
