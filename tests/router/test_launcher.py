"""``tokenmill serve --data-parallel-size 2``: two replica processes behind the router; one
dying shows in the log and in /health; SIGTERM to the parent stops everything, status 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
from router_helpers import KEY, MODEL_NAME, REPLICA_FLAGS, free_port, wait_healthy

from tokenmill.cli import main
from tokenmill.router.policy import rank, request_key

ADMIN = "admin-key"


def test_serve_data_parallel_starts_answers_and_stops(tiny_model_dir, tmp_path) -> None:
    port = free_port()
    while any(_in_use(port + i) for i in (1, 2)):
        port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_model_dir("llama")),
           *REPLICA_FLAGS, "--port", str(port), "--api-key", KEY, "--admin-api-key", ADMIN,
           "--usage-db", str(tmp_path / "usage.db"), "--usage-flush-interval", "0.1",
           "--data-parallel-size", "2"]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        parent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    children: list[psutil.Process] = []
    try:
        wait_healthy(url, 120, parent, log_path)
        _wait(lambda: all(r["healthy"] for r in httpx.get(f"{url}/health").json()["replicas"]))
        children = psutil.Process(parent.pid).children()
        assert sorted(_port_of(c) for c in children) == [port + 1, port + 2]

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        args = dict(model=MODEL_NAME, prompt="Hello, router", max_tokens=8, temperature=0)
        first = client.completions.create(**args)
        assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 8
        # One request on each replica: both meter into the one --usage-db, so /v1/usage
        # through the router (answered by either) counts them all.
        urls = [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
        other = 1 - rank(request_key({"prompt": args["prompt"]}), urls)[0]
        prompt = next(p for p in (f"Prompt {i}" for i in range(100))
                      if rank(request_key({"prompt": p}), urls)[0] == other)  # fmt: skip
        client.completions.create(**(args | {"prompt": prompt}))
        admin = {"Authorization": f"Bearer {ADMIN}"}

        def metered() -> int:
            usage = httpx.get(f"{url}/v1/usage", headers=admin).json()
            return usage["total"]["requests"]

        sent = httpx.get(f"{url}/metrics", headers=admin).text
        for replica_url in urls:
            assert f'replica_requests_total{{replica="{replica_url}"}} 1.0' in sent
        _wait(lambda: metered() == 2)
        assert (
            httpx.get(f"{url}/v1/usage", headers=admin).json()["total"]["completion_tokens"] == 16
        )

        # A replica that dies is logged and shown by /health; the other serves on.
        victim = next(c for c in children if _port_of(c) == port + 2)
        victim.send_signal(signal.SIGKILL)

        def reported() -> bool:
            return httpx.get(f"{url}/health").json()["replicas"][1].get("exit_status") == -9

        _wait(reported)
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["replicas"][0]["healthy"] is True
        assert health["replicas"][1]["healthy"] is False
        for prompt in ("Hello, router", "Another prompt", "And a third one"):
            again = client.completions.create(**(args | {"prompt": prompt}))
            assert again.choices[0].finish_reason == "length"
        assert client.completions.create(**args).choices[0].text == first.choices[0].text
        assert f"replica http://127.0.0.1:{port + 2} (pid {victim.pid}) exited with status -9" in (
            log_path.read_text()
        )

        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        for proc in [*children, psutil.Process(parent.pid) if parent.poll() is None else None]:
            if proc is not None and proc.is_running():
                proc.kill()


def test_data_parallel_size_is_checked(capsys) -> None:
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "2", "--port", "0"]) == 2
    assert "fixed --port" in capsys.readouterr().err
    assert main(["router", "--replica", "localhost:8001"]) == 2
    assert "http(s)://" in capsys.readouterr().err


def _port_of(proc: psutil.Process) -> int:
    argv = proc.cmdline()
    return int(argv[len(argv) - 1 - argv[::-1].index("--port") + 1])


def _in_use(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=0.5)
    except httpx.TransportError:
        return False
    return True


def _wait(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
