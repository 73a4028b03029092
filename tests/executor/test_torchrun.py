"""An engine whose ranks torchrun started (``torchrun -m tokenmill.worker.torchrun``): TP=2
serving over HTTP from rank 0 against TP=1 in process on a tiny random model, a clean exit
of every rank, and the executor refused outside torchrun."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tokenmill import LLM
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["hello world", "the quick brown fox jumps"]
# As tests/executor/test_multiproc.py: fp32 on both sides, partial sums added in another order.
LOGPROB_TOL = 1e-4
ENGINE_FLAGS = ["--kv-cache-memory", "8MiB", "--max-model-len", "256"]


def _torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        "-m",
        "tokenmill.worker.torchrun",
        *args,
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_under_torchrun_matches_tp1(tiny_model_dir, tmp_path) -> None:
    model = str(tiny_model_dir("llama"))
    llm = LLM(model, kv_cache_memory="8MiB", max_model_len=256)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
        expected = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()

    port = _free_port()
    log = tmp_path / "torchrun.log"  # a file, not a pipe: a full pipe would block the server
    with log.open("w") as out:
        proc = subprocess.Popen(
            _torchrun("serve", model, "--port", str(port), *ENGINE_FLAGS),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # torchrun and its ranks: one group to stop on failure
        )
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = dict(model=model, max_tokens=6, temperature=0.0, logprobs=1)
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                r = httpx.post(url, json=dict(body, prompt=PROMPTS[0]), timeout=30)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the torchrun server did not come up"
            time.sleep(0.5)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            r = httpx.post(url, json=dict(body, prompt=prompt), timeout=30)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == want.outputs[0].text
            got = choice["logprobs"]["token_logprobs"]
            assert got == pytest.approx(
                [p.sampled.logprob for p in want.outputs[0].logprobs], abs=LOGPROB_TOL
            )
        # Rank 0's server drains and tells rank 1 to stop: torchrun sees both exit 0.
        (rank0,) = [
            c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "0"
        ]
        rank0.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_generate_under_torchrun_exits_cleanly(tiny_model_dir) -> None:
    """generate leaves its engine to the interpreter's exit: rank 0 still tells rank 1 to
    stop, so torchrun sees both exit 0. With async scheduling: each step is a "launch" and a
    "collect" on both ranks, and the text is the one of TP=1 stepping one at a time."""
    model = str(tiny_model_dir("llama"))
    llm = LLM(model, kv_cache_memory="8MiB", max_model_len=256)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0)
        want = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.engine.shutdown()
    proc = subprocess.run(
        _torchrun(
            "generate",
            model,
            "--max-tokens",
            "8",
            "--prompt",
            PROMPTS[1],
            "--async-scheduling",
            *ENGINE_FLAGS,
        ),  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == want


def test_torchrun_executor_outside_torchrun_is_refused(tiny_model_dir, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"runs under torchrun .*-m tokenmill.worker.torchrun"):
        LLM(
            str(tiny_model_dir("llama")),
            tensor_parallel_size=2,
            distributed_executor="torchrun",
            kv_cache_memory="8MiB",
        )
