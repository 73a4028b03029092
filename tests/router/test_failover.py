"""A replica killed mid-run: requests it had not started streaming retry on the other one and
finish with the text they would have had; the router's /metrics and /health say what happened."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from router_helpers import AUTH, MODEL_NAME, RouterThread, scrape, start_replicas

from tokenmill.router.policy import Reason, ReplicaView, choose, request_key

MAX_TOKENS = 96


class StreamClient(threading.Thread):
    """One streamed completion through the router, recording when its first token came."""

    def __init__(self, url: str, prompt: str, max_tokens: int = MAX_TOKENS, n: int = 1) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens, self.n = url, prompt, max_tokens, n
        self.text = ""
        self.first_token_at: float | None = None
        self.errors: list[dict] = []
        self.finish_reason: str | None = None
        self.replica: str | None = None

    def run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "n": self.n}  # fmt: skip
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:  # fmt: skip
            self.replica = r.headers.get("x-tokenmill-replica")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                choice = event["choices"][0]
                if choice["text"] and self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.text += choice["text"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what()}"
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("how", "lost_code"),
    [("kill", "replica_lost"), ("drain", "aborted")],
    ids=["SIGKILL", "SIGTERM"],
)
def test_a_replica_that_goes_loses_no_request_it_had_not_started(
    tiny_model_dir, tmp_path, how: str, lost_code: str
) -> None:
    """SIGKILL: the connections break. SIGTERM with --shutdown-timeout 0: the replica aborts
    what it runs and what it queued, each with an error event; the queued ones retry."""
    # One running request per replica: the others wait in its queue, not yet streaming.
    replicas = start_replicas(tiny_model_dir("llama"), tmp_path, 2, "--max-num-seqs", "1")
    urls = [r.url for r in replicas]
    router = RouterThread(urls).start()
    try:
        views = [ReplicaView(u) for u in urls]
        prompts = [f"Story number {i}: once upon a time" for i in range(200)]
        on_victim = [
            p for p in prompts if choose(request_key({"prompt": p}), views).replica_idx == 0
        ]
        first, *queued = on_victim[:4]
        expected = {}
        for p in queued:
            body = {"model": MODEL_NAME, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{urls[1]}/v1/completions", json=body, headers=AUTH, timeout=120)
            expected[p] = r.json()["choices"][0]["text"]
        before = scrape(router.url)

        # n=4 at one sequence at a time: the others queue behind 4 x 400 tokens, time enough
        # for them to arrive even on a loaded machine.
        running = StreamClient(router.url, first, max_tokens=400, n=4)
        running.start()
        _wait(
            lambda: running.first_token_at is not None,
            lambda: f"a first token: {running.errors} {running.is_alive()}",
        )
        waiting = [StreamClient(router.url, p) for p in queued]
        for client in waiting:
            client.start()
        _wait(
            lambda: router.replicas[0].in_flight == 4,
            lambda: f"4 in flight: {router.replicas.status()} {running.finish_reason}",
        )
        killed_at = time.monotonic()
        if how == "kill":
            replicas[0].kill()
        else:
            replicas[0].proc.send_signal(signal.SIGTERM)
        for client in [running, *waiting]:
            client.join(120)
            assert not client.is_alive()

        # The one that was streaming ends with an error event; the rest finish.
        assert running.replica == urls[0] and running.text
        assert [e["code"] for e in running.errors] == [lost_code]
        for client in waiting:
            assert client.errors == []
            assert client.replica == urls[1]
            assert client.first_token_at > killed_at
            assert client.finish_reason == "length"
            assert client.text == expected[client.prompt]

        after = scrape(router.url)

        def delta(name: str) -> float:
            return after[name] - before.get(name, 0.0)

        assert delta("tokenmill_router:routing_decisions_total{reason=retry}") == 3
        assert delta("tokenmill_router:routing_decisions_total{reason=prefix_hit}") == 4
        assert delta(f"tokenmill_router:replica_failures_total{{replica={urls[0]}}}") == 3
        assert delta(f"tokenmill_router:replica_requests_total{{replica={urls[1]}}}") == 3
        assert after[f"tokenmill_router:replica_healthy{{replica={urls[0]}}}"] == 0
        assert after[f"tokenmill_router:replica_healthy{{replica={urls[1]}}}"] == 1
        assert after[f"tokenmill_router:replica_in_flight{{replica={urls[0]}}}"] == 0

        # Later requests of the dead replica's keys go to the key's next replica at once.
        late = StreamClient(router.url, on_victim[4], max_tokens=4)
        late.run()
        assert late.replica == urls[1] and late.finish_reason == "length"
        decisions = router.replicas.decisions
        assert decisions[Reason.NEXT_HEALTHY] == 1
        health = httpx.get(f"{router.url}/health").json()
        assert health["status"] == "ok"
        assert [r["healthy"] for r in health["replicas"]] == [False, True]
        assert "error" in health["replicas"][0]
    finally:
        router.stop()
        for r in replicas:
            r.stop()
