"""One `tokenmill serve` for every model here (host/): a real host process with real runners
(`tokenmill serve MODEL` subprocesses) over a model directory of three tiny models, through
the ollama and openai SDKs: the listing, two models chatted with alternately, /api/ps,
keep_alive 0 unloading, the least recently used idle model evicted for a third, a model with
a stream in flight never evicted (the stream completes exactly), 404s naming the models."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from browser import IN_CI, browser_context, requires_chromium  # noqa: E402

KEY = "sk-host-test"
NAMES = ("alpha", "beta", "gamma")
# One thread each and small KV caches: the runners and the test share 2 cores.
FLAGS = ["--max-model-len", "256", "--kv-cache-memory", "8MiB", "--num-threads", "1",
         "--log-stats-interval", "0", "--shutdown-timeout", "5"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Host:
    def __init__(self, model_dir: Path, log: Path, *extra: str) -> None:
        self.port = _free_port()
        self.log_path = log
        self.log = log.open("w")
        env = {**os.environ, "TOKENMILL_MODEL_DIR": str(model_dir)}
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(self.port),
               "--api-key", KEY, *FLAGS, *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def loaded(self) -> list[str]:
        ps = httpx.get(f"{self.url}/api/ps", headers={"Authorization": f"Bearer {KEY}"}).json()
        return sorted(m["name"].removesuffix(":latest") for m in ps["models"])

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(60) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        return self.log_path.read_text()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("host-models")
    for name, arch in zip(NAMES, ("llama", "qwen3", "llama")):
        shutil.copytree(tiny_model_dir(arch), root / name)
    return root


@pytest.fixture(scope="module")
def host(model_dir, tmp_path_factory):
    host = Host(model_dir, tmp_path_factory.mktemp("host") / "host.log",
                "--max-loaded-models", "2")  # fmt: skip
    yield host
    log = host.stop()
    assert "Traceback" not in log, log[-3000:]
    assert "[alpha] " in log and "tokenmill.server.api: serving 'alpha'" in log  # its runner's


@pytest.fixture(scope="module")
def client(host) -> ollama.Client:
    return ollama.Client(host=host.url, headers={"Authorization": f"Bearer {KEY}"})


def _chat(client: ollama.Client, name: str, **kwargs) -> str:
    reply = client.chat(model=name, messages=[{"role": "user", "content": "hi"}],
                        options={"num_predict": 4, "temperature": 0}, **kwargs)  # fmt: skip
    return reply.message.content


def test_every_model_is_listed_loaded_or_not(host, client) -> None:
    names = {m.model.removesuffix(":latest") for m in client.list().models}
    assert set(NAMES) <= names
    oai = openai.OpenAI(base_url=f"{host.url}/v1", api_key=KEY, max_retries=0)
    assert set(NAMES) <= {m.id for m in oai.models.list().data}
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and "alpha" in str(exc.value)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    shown = client.show("beta")  # read from its files, as Ollama's: nothing loads
    assert shown.details.family == "qwen3" and shown.modelinfo["general.architecture"] == "qwen3"
    assert host.loaded() == []


def test_two_models_alternately_then_keep_alive_0_unloads(host, client) -> None:
    first = [_chat(client, "alpha"), _chat(client, "beta:latest")]
    again = [_chat(client, "alpha"), _chat(client, "beta")]
    assert first == again and all(first)
    assert host.loaded() == ["alpha", "beta"]
    assert {m.model for m in client.ps().models} == {"alpha:latest", "beta:latest"}
    oai = openai.OpenAI(base_url=f"{host.url}/v1", api_key=KEY, max_retries=0)
    reply = oai.chat.completions.create(model="beta", max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert reply.model == "beta" and reply.choices[0].message.content is not None
    client.generate(model="alpha", keep_alive=0)  # Ollama's unload: no prompt, keep_alive 0
    assert host.loaded() == ["beta"]
    client.generate(model="alpha")  # and its load
    assert host.loaded() == ["alpha", "beta"]


def test_the_least_recently_used_idle_model_makes_room(host, client) -> None:
    _chat(client, "alpha")
    _chat(client, "beta")  # alpha is now the least recently used
    _chat(client, "gamma")
    assert host.loaded() == ["beta", "gamma"]


def test_a_model_with_a_stream_in_flight_is_never_evicted(host, client) -> None:
    _chat(client, "gamma")
    _chat(client, "beta")
    # gamma is least recently used, but streams: alpha must take beta's place, not gamma's.
    options = {"num_predict": 48, "temperature": 0}
    whole = client.generate(model="gamma", prompt="x", options=options).response
    stream = client.generate(model="gamma", prompt="x", options=options, stream=True)
    parts = [next(stream).response]
    _chat(client, "alpha")
    assert host.loaded() == ["alpha", "gamma"]
    parts += [chunk.response for chunk in stream]
    assert "".join(parts) == whole


def test_models_made_from_a_modelfile(host, client) -> None:
    client.create(model="mario", from_="alpha", system="You are Mario.",
                  parameters={"num_predict": 3})  # fmt: skip
    assert "mario:latest" in {m.model for m in client.list().models}
    greedy = {"temperature": 0}
    reply = client.chat(model="mario", messages=[{"role": "user", "content": "hi"}],
                        options=greedy)  # fmt: skip
    assert reply.eval_count == 3  # its PARAMETER
    # The same as its base given the SYSTEM message by hand.
    by_hand = client.chat(model="alpha", options={**greedy, "num_predict": 3}, messages=[
        {"role": "system", "content": "You are Mario."}, {"role": "user", "content": "hi"}])  # fmt: skip
    assert reply.message.content == by_hand.message.content
    assert reply.prompt_eval_count == by_hand.prompt_eval_count
    shown = client.show("mario")
    assert 'SYSTEM """You are Mario."""' in shown.modelfile and "num_predict 3" in shown.parameters
    client.copy("mario", "luigi")
    assert client.chat(model="luigi", messages=[{"role": "user", "content": "hi"}],
                       options=greedy).message.content == reply.message.content  # fmt: skip
    client.delete("luigi")
    assert "luigi:latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as exc:
        client.delete("alpha")  # a model's own directory: never
    assert exc.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as exc:
        client.create(model="t", from_="alpha", template="{{ messages }}")
    assert exc.value.status_code == 403  # a TEMPLATE takes the admin key
    with pytest.raises(ollama.ResponseError) as exc:
        client.create(model="t", from_="nope")
    assert exc.value.status_code == 400 and "alpha" in str(exc.value)


def test_load_duration_is_the_wait_for_the_load(host, client) -> None:
    client.generate(model="alpha", keep_alive=0)
    first = client.generate(model="alpha", prompt="x", options={"num_predict": 2})
    assert first.load_duration > 10_000_000  # ns: a runner takes far more than 10 ms to start
    assert first.total_duration > first.load_duration + first.eval_duration
    again = client.generate(model="alpha", prompt="x", options={"num_predict": 2})
    assert again.load_duration == 0
    # Sent by a client, the host's header is replaced by its own.
    spoofed = httpx.post(f"{host.url}/api/generate", headers={
        "Authorization": f"Bearer {KEY}", "X-Tokenmill-Load-Duration": "99"}, json={
        "model": "alpha", "prompt": "x", "stream": False, "options": {"num_predict": 2}})  # fmt: skip
    assert spoofed.json()["load_duration"] == 0


@requires_chromium
def test_the_dashboard_shows_each_loaded_model(host, client, tmp_path) -> None:
    """/dashboard on the host: a select of the loaded models; the chosen one's figures come
    from its own runner, and watching it neither loads a model nor keeps one alive."""
    _chat(client, "alpha")
    _chat(client, "beta")
    auth = {"Authorization": f"Bearer {KEY}"}
    expiry = {m.model: m.expires_at for m in client.ps().models}
    stats = httpx.get(f"{host.url}/v1/stats", params={"model": "alpha"}, headers=auth)
    assert stats.status_code == 200 and stats.json()["model"] == "alpha"
    absent = httpx.get(f"{host.url}/v1/stats", params={"model": "gamma"}, headers=auth)
    assert absent.status_code == 404 and "alpha, beta" in absent.text
    with browser_context(tmp_path) as browser:
        page = browser.new_page()
        page.goto(f"{host.url}/dashboard?interval_ms=200")
        page.wait_for_selector("#key-form.shown", timeout=10_000)
        page.fill("#api-key", KEY)
        page.click("#save-key")
        page.wait_for_selector("#model-select:not([hidden])", timeout=10_000)
        options = page.eval_on_selector_all("#model-select option", "os => os.map(o => o.value)")
        assert sorted(options) == ["alpha", "beta"]
        page.select_option("#model-select", "alpha")
        page.wait_for_function("window.tokenmillDashboard.last?.model === 'alpha'", timeout=10_000)
        assert "model=alpha" in page.url
        page.select_option("#model-select", "beta")
        page.wait_for_function("window.tokenmillDashboard.last?.model === 'beta'", timeout=10_000)
    for m in client.ps().models:  # as they were (/api/ps computes them anew: jitter aside)
        assert abs((m.expires_at - expiry[m.model]).total_seconds()) < 0.1, m.model
    assert host.loaded() == ["alpha", "beta"]


def test_metrics_carry_each_models_name(host, client) -> None:
    _chat(client, "alpha")
    text = httpx.get(f"{host.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'tokenmill:host_loaded_models{model_name="alpha"} 1.0' in text
    assert 'model_name="alpha"' in text and "tokenmill:generation_tokens_total" in text
    # Nothing left running or waiting in any loaded model's engine.
    for family in text_string_to_metric_families(text):
        if family.name in ("tokenmill:num_requests_running", "tokenmill:num_requests_waiting"):
            assert all(sample.value == 0 for sample in family.samples)


def test_loads_and_unloads_leave_nothing_behind(host, client) -> None:
    """10 load / unload cycles: each runner's process is gone after its unload, and the
    host's own memory stays where it was (10 cycles, not 20: a runner's start is ~4 s on a
    2-core CI machine, and 1.6 MiB held a cycle still fails the bound)."""
    for name in host.loaded():
        client.generate(model=name, keep_alive=0)
    client.generate(model="alpha")
    client.generate(model="alpha", keep_alive=0)
    before = _resident(host.proc.pid)
    pids = []
    for _ in range(10):
        client.generate(model="alpha")
        health = httpx.get(f"{host.url}/health").json()
        pids += [m["pid"] for m in health["loaded"]]
        client.generate(model="alpha", keep_alive=0)
        assert host.loaded() == []
    assert len(set(pids)) == 10 and not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert _resident(host.proc.pid) - before < 16 * 2**20


def _resident(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_npm_ollama_client(host, tmp_path_factory) -> None:
    """The ollama JavaScript client from npm, run with Node: a second real client."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        # CI has them (.ci/run installs them): there, their absence is a failure.
        assert not IN_CI, "node and npm are missing in CI"
        pytest.skip("needs node and npm")
    packages = Path.home() / ".cache" / "tokenmill-tests" / "npm"
    if not (packages / "node_modules" / "ollama").exists():
        subprocess.run([npm, "install", "--prefix", str(packages), "--no-audit", "--no-fund",
                        "--silent", "ollama@0.6.4"], check=True, timeout=300)  # fmt: skip
    for name in host.loaded():
        httpx.post(f"{host.url}/api/generate", json={"model": name, "keep_alive": 0},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    script = Path(__file__).with_name("ollama_client.mjs")
    result = subprocess.run(
        [node, str(script), host.url, KEY], capture_output=True, text=True, timeout=120,
        env={**os.environ, "NODE_PATH": str(packages / "node_modules")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert {"alpha:latest", "beta:latest", "gamma:latest", "mario-js:latest"} <= set(seen["listed"])
    assert 'SYSTEM """You are Mario."""' in seen["created"]
    assert "mario-js:latest" not in seen["remaining"]
    alpha, beta, alpha_again, beta_again = seen["replies"]
    assert alpha == alpha_again and beta == beta_again
    assert seen["loaded"] == ["alpha:latest", "beta:latest"]
    assert seen["after"] == ["beta:latest"]
    assert seen["missing"] == 404


def test_openapi_describes_the_models_routes_and_the_hosts(host) -> None:
    doc = httpx.get(f"{host.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    for path, method in (("/v1/chat/completions", "post"), ("/api/chat", "post"),
                         ("/api/create", "post"), ("/api/copy", "post"),
                         ("/api/delete", "delete")):  # fmt: skip
        assert method in doc["paths"][path], path


def test_fuzzed_requests_to_the_hosts_own_routes(host, tmp_path) -> None:
    """schemathesis on the host's own operations (create, copy, delete, show, ps, tags): no
    5xx, and answers as documented; its examples create, copy and delete a model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
    from test_fuzz_openapi import run_fuzz

    # The document comes from a loaded model's runner (else the default model's would load).
    httpx.post(f"{host.url}/api/generate", json={"model": "alpha"},
               headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip

    run = run_fuzz(host.url, KEY, 30, tmp_path, paths="^/api/(create|copy|delete|show|ps|tags)$")
    assert run.server_errors == [], run.server_errors[:5]
    assert run.returncode == 0, run.output[-6000:]
    assert run.statuses[("POST /api/create", 200)] >= 1
