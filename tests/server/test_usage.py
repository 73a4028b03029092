"""Per-key usage metering (server/usage.py) through a real server: concurrent clients on two
keys, streamed and not, some leaving early; the usage route's totals against the ``usage``
the clients were sent; a restart over the same database; who may read what; the query's 4xx."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from live_server import MODEL_NAME, free_port, running_server, scrape

from tokenmill.cost import TokenPrices
from tokenmill.server.auth import Caller, key_id_of
from tokenmill.server.errors import APIError
from tokenmill.server.usage import UsageQuery, parse_usage_query

KEY_A, KEY_B, ADMIN = "sk-user-a", "sk-user-b", "sk-admin"
ID_A, ID_B, ID_ADMIN = key_id_of(KEY_A), key_id_of(KEY_B), key_id_of(ADMIN)
PRICES = TokenPrices(input_per_million=0.1, output_per_million=0.4, cached_input_per_million=0.05)
# Two full 16-token blocks and a tail: a repeat of it hits the prefix cache.
SHARED_PROMPT = "The same long system prompt, then: tell me a story."
LEAVER_TOKENS = 200
KINDS = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _usage_dict(usage: dict) -> dict[str, int]:
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "cached_prompt_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "completion_tokens": usage["completion_tokens"],
    }


def _add(total: dict[str, int], usage: dict[str, int]) -> None:
    for kind in KINDS:
        total[kind] += usage[kind]
    total["requests"] += 1


def _zero() -> dict[str, int]:
    return dict.fromkeys((*KINDS, "requests"), 0)


async def _count_tokens(client: httpx.AsyncClient, key: str, **body) -> int:
    r = await client.post("/tokenize", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    return r.json()["count"]


async def _completion(client, key, prompt, user=None, **extra) -> dict[str, int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0} | extra
    if user is not None:
        body["user"] = user
    r = await client.post("/v1/completions", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    return _usage_dict(r.json()["usage"])


async def _chat(client, key, text, user=None) -> dict[str, int]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
            "max_tokens": 6, "n": 2, "temperature": 0.9, "seed": 1}  # fmt: skip
    if user is not None:
        body["user"] = user
    r = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    return _usage_dict(r.json()["usage"])


async def _stream_with_usage(client, key, text, user=None) -> dict[str, int]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
            "max_tokens": 10, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if user is not None:
        body["user"] = user
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    assert usage is not None
    return _usage_dict(usage)


async def _stream_without_usage(client, key, prompt, user=None) -> dict[str, int]:
    """No usage comes back: what it would have been is the prompt's length (/tokenize), the
    max_tokens it ran to (ignore_eos, finish "length"), and no cached tokens (its own salt)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
            "stream": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
    if user is not None:
        body["user"] = user
    finish = None
    async with client.stream("POST", "/v1/completions", json=body, headers=_auth(key)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "usage" not in chunk
                finish = chunk["choices"][0]["finish_reason"] or finish
    assert finish == "length"
    num_prompt = await _count_tokens(client, key, prompt=prompt)
    return {"prompt_tokens": num_prompt, "cached_prompt_tokens": 0, "completion_tokens": 12}


async def _leave_early(client, key, prompt) -> tuple[int, int]:
    """A stream the client leaves after its first chunk; (prompt tokens, tokens it saw)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": LEAVER_TOKENS,
            "ignore_eos": True, "stream": True, "logprobs": 0,
            "cache_salt": uuid.uuid4().hex}  # fmt: skip
    seen = 0
    async with client.stream("POST", "/v1/completions", json=body, headers=_auth(key)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                break
    return await _count_tokens(client, key, prompt=prompt), seen


async def _leave_unstreamed(client, key, prompt) -> tuple[int, dict[str, int] | None]:
    """A non-streamed request whose client gives up after 50 ms: (prompt tokens, None); or
    (prompt tokens, its usage) if it finished that fast after all."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": LEAVER_TOKENS,
            "ignore_eos": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
    num_prompt = await _count_tokens(client, key, prompt=prompt)
    try:
        r = await client.post("/v1/completions", json=body, headers=_auth(key), timeout=0.05)
    except httpx.TimeoutException:
        return num_prompt, None
    return num_prompt, _usage_dict(r.json()["usage"])


async def _ollama(client, key, prompt) -> dict[str, int]:
    # raw: the prompt as given, so a unique prompt shares no cached block with another.
    body = {"model": MODEL_NAME, "prompt": prompt, "raw": True, "stream": False,
            "options": {"num_predict": 5, "temperature": 0}}  # fmt: skip
    r = await client.post("/api/generate", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    out = r.json()
    return {"prompt_tokens": out["prompt_eval_count"], "cached_prompt_tokens": 0,
            "completion_tokens": out["eval_count"]}  # fmt: skip


async def _failing(client, key) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10_000}
    r = await client.post("/v1/completions", json=body, headers=_auth(key))
    assert r.status_code == 400


async def _load(url: str) -> tuple[dict, dict, list[tuple[int, int]], list[int]]:
    """Known usage per key and per (key, user); on key B, the streamed leavers' (prompt, seen)
    and the prompt tokens of the non-streamed ones that left."""
    known = {KEY_A: _zero(), KEY_B: _zero()}
    by_user: dict[tuple[str, str], dict[str, int]] = {}

    def count(key: str, usage: dict[str, int], user: str | None = None) -> None:
        _add(known[key], usage)
        if user is not None:
            _add(by_user.setdefault((key, user), _zero()), usage)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        # One after the other, so the second hits the prefix cache: cached tokens are metered.
        for _ in range(2):
            count(KEY_A, await _completion(client, KEY_A, SHARED_PROMPT, "alice"), "alice")
        assert known[KEY_A]["cached_prompt_tokens"] > 0
        jobs = []
        for i in range(4):
            jobs.append((KEY_A, "alice", _completion(client, KEY_A, f"A{i} hello", "alice")))
            jobs.append((KEY_A, "bob", _stream_with_usage(client, KEY_A, f"A{i} stream", "bob")))
            jobs.append((KEY_B, None, _chat(client, KEY_B, f"B{i} chat")))
            jobs.append((KEY_B, "carol", _stream_without_usage(client, KEY_B, f"B{i}", "carol")))
        jobs.append((KEY_A, None, _ollama(client, KEY_A, f"{uuid.uuid4().hex} ollama")))
        leavers = [_leave_early(client, KEY_B, f"B leaver {i}") for i in range(3)]
        unstreamed = [_leave_unstreamed(client, KEY_B, f"B quitter {i}") for i in range(2)]
        failing = [_failing(client, KEY_A), _failing(client, KEY_B)]
        results = await asyncio.gather(
            *(job for _, _, job in jobs), *leavers, *unstreamed, *failing
        )
    for (key, user, _), usage in zip(jobs, results):
        count(key, usage, user)
    num_jobs, num_leavers = len(jobs), len(leavers)
    quitters = []
    for num_prompt, usage in results[num_jobs + num_leavers : num_jobs + num_leavers + 2]:
        if usage is None:
            quitters.append(num_prompt)
        else:  # it finished within the 50 ms
            count(KEY_B, usage)
    return known, by_user, list(results[num_jobs : num_jobs + num_leavers]), quitters


def _report(url: str, as_key: str, **params) -> dict:
    r = httpx.get(f"{url}/v1/usage", params=params, headers=_auth(as_key))
    assert r.status_code == 200, r.text
    return r.json()


def _counts(report_row: dict) -> dict[str, int]:
    return {k: report_row[k] for k in (*KINDS, "requests")}


def _wait_generation_tokens(url: str, want_aborts: int) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while True:
        metrics = scrape(url, _auth(ADMIN))
        if metrics.get("tokenmill:request_success_total{finished_reason=abort}") == want_aborts:
            return metrics
        assert time.monotonic() < deadline, "the leavers were not aborted"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("usage") / "usage.db")


def _server(tiny_model_dir, db_path: str, **config):
    config = (
        dict(api_keys=(KEY_A, KEY_B), admin_api_key=ADMIN, usage_db=db_path, prices=PRICES) | config
    )
    return running_server(tiny_model_dir("llama"), **config)


def test_metered_usage_equals_the_clients_usage_and_survives_a_restart(
    tiny_model_dir, db_path
) -> None:
    with _server(tiny_model_dir, db_path) as server:
        known, by_user, leavers, quitters = asyncio.run(_load(server.url))
        server.wait_idle()
        metrics = _wait_generation_tokens(server.url, len(leavers) + len(quitters))
        # Every token the engine sent was metered (nothing failed), so what the clients that
        # left were metered is the server's token counts beyond the known usage: generation
        # tokens, and the prompts of those that had their first token.
        known_completion = sum(known[k]["completion_tokens"] for k in known)
        left = metrics["tokenmill:generation_tokens_total"] - known_completion
        num_left = len(leavers) + len(quitters)
        assert sum(seen for _, seen in leavers) <= left < num_left * LEAVER_TOKENS
        known_prompt = sum(known[k]["prompt_tokens"] for k in known)
        left_prompt = metrics["tokenmill:prompt_tokens_total"] - known_prompt
        leaver_prompt = sum(p for p, _ in leavers)  # they saw a token: their prompt ran
        assert leaver_prompt <= left_prompt <= leaver_prompt + sum(quitters)
        expected_b = dict(known[KEY_B])
        expected_b["completion_tokens"] += int(left)
        expected_b["prompt_tokens"] += int(left_prompt)
        expected_b["requests"] += num_left

        a = _report(server.url, ADMIN, key=KEY_A)
        assert a["key_id"] == ID_A
        assert _counts(a["total"]) == known[KEY_A]
        b = _report(server.url, ADMIN, key_id=ID_B)
        assert _counts(b["total"]) == expected_b
        for report, want in ((a, known[KEY_A]), (b, expected_b)):
            cost = PRICES.cost(
                want["prompt_tokens"], want["completion_tokens"], want["cached_prompt_tokens"]
            )
            assert report["total"]["cost_usd"] == pytest.approx(cost, rel=1e-9)
            assert report["total"]["total_tokens"] == (
                want["prompt_tokens"] + want["completion_tokens"]
            )
        # A user key reads its own usage without naming it, and by name.
        assert _report(server.url, KEY_A)["total"] == a["total"]
        assert _report(server.url, KEY_A, key=KEY_A)["total"] == a["total"]
        # Per user of a key, and grouped.
        alice = _report(server.url, ADMIN, key=KEY_A, user="alice")
        assert _counts(alice["total"]) == by_user[(KEY_A, "alice")]
        users = _report(server.url, KEY_B, group_by="user")["data"]
        assert {row["user"]: _counts(row) for row in users}["carol"] == by_user[(KEY_B, "carol")]
        grouped = _report(server.url, ADMIN, group_by="key")
        assert {row["key_id"]: _counts(row) for row in grouped["data"]} == {
            ID_A: known[KEY_A],
            ID_B: expected_b,
        }
        days = _report(server.url, ADMIN, group_by="day")["data"]
        assert [row["day"] for row in days] == [time.strftime("%Y-%m-%d", time.gmtime())]
        (model,) = _report(server.url, ADMIN, group_by="model")["data"]
        assert model["model"] == MODEL_NAME and model["requests"] == grouped["total"]["requests"]
        # A window after now holds nothing.
        later = _report(server.url, ADMIN, since=str(time.time() + 60))
        assert later["total"]["requests"] == 0 and later["data"][0]["requests"] == 0

        # /metrics: the same counts per key id (the key itself appears nowhere).
        text = httpx.get(f"{server.url}/metrics", headers=_auth(ADMIN)).text
        assert KEY_A not in text and KEY_B not in text
        metrics = scrape(server.url, _auth(ADMIN))
        for key_id, want in ((ID_A, known[KEY_A]), (ID_B, expected_b)):
            for kind, name in (("prompt", "prompt_tokens"), ("cached_prompt", "cached_prompt_tokens"),
                               ("completion", "completion_tokens")):  # fmt: skip
                sample = f"tokenmill:usage_tokens_total{{key_id={key_id},kind={kind}}}"
                assert metrics[sample] == want[name]
            assert metrics[f"tokenmill:usage_requests_total{{key_id={key_id}}}"] == want["requests"]
        before = _report(server.url, ADMIN, group_by="key")

    # A new server over the same database keeps the totals (the shutdown flushed them).
    with _server(tiny_model_dir, db_path) as server:
        assert _report(server.url, ADMIN, group_by="key") == before


def test_user_keys_read_only_their_own_usage(tiny_model_dir, tmp_path) -> None:
    with _server(tiny_model_dir, str(tmp_path / "u.db")) as server:
        for params in ({"key": KEY_B}, {"key_id": ID_B}, {"key_id": ID_ADMIN}):
            r = httpx.get(f"{server.url}/v1/usage", params=params, headers=_auth(KEY_A))
            assert r.status_code == 403
            error = r.json()["error"]
            assert error["code"] == "permission_denied"
            assert error["type"] == "permission_error"
            assert error["param"] in ("key", "key_id")
            assert KEY_B not in r.text
        # group_by=key from a user key: only its own row.
        asyncio.run(_one_each(server.url))
        rows = _report(server.url, KEY_A, group_by="key")["data"]
        assert [row["key_id"] for row in rows] == [ID_A]
        assert httpx.get(f"{server.url}/v1/usage").status_code == 401
        # Only the admin key resets the prefix cache once there is one.
        r = httpx.post(f"{server.url}/reset_prefix_cache", headers=_auth(KEY_A))
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        r = httpx.post(f"{server.url}/reset_prefix_cache", headers=_auth(ADMIN))
        assert r.status_code == 200 and r.json() == {"reset": True}


async def _one_each(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await _completion(client, KEY_A, "a")
        await _completion(client, KEY_B, "b")


@pytest.mark.parametrize(
    ("params", "param", "code"),
    [
        ({"group_by": "week"}, "group_by", "invalid_value"),
        ({"since": "yesterday"}, "since", "invalid_value"),
        ({"until": "nan"}, "until", "invalid_value"),
        ({"since": "100", "until": "50"}, "until", "invalid_value"),
        ({"key": KEY_A, "key_id": ID_A}, "key_id", "invalid_value"),
        ({"key_id": "ABC"}, "key_id", "invalid_value"),
        ({"key": ""}, "key", "invalid_value"),
        ({"limit": "3"}, "limit", "unknown_field"),
        ([("user", "a"), ("user", "b")], "user", "invalid_value"),
    ],
)
def test_bad_queries_are_400_naming_the_parameter(params, param, code) -> None:
    items = params if isinstance(params, list) else list(params.items())
    with pytest.raises(APIError) as exc:
        parse_usage_query(items, Caller(ID_ADMIN, is_admin=True))
    assert exc.value.status == 400
    assert (exc.value.param, exc.value.code) == (param, code)


def test_query_times_and_ownership() -> None:
    admin = Caller(ID_ADMIN, is_admin=True)
    q = parse_usage_query([("since", "2026-01-31"), ("until", "2026-02-01T12:00:00Z")], admin)
    assert (q.since, q.until) == (1769817600.0, 1769947200.0)
    assert parse_usage_query([("since", "1769817600.5")], admin).since == 1769817600.5
    assert parse_usage_query([("key", KEY_B)], admin).key_id == ID_B
    assert parse_usage_query([("key_id", "none")], admin).key_id == "none"  # no-key requests
    # A user key's query is always its own.
    assert parse_usage_query([], Caller(ID_A)) == UsageQuery(key_id=ID_A)


def test_the_flusher_writes_in_the_background(tiny_model_dir, tmp_path) -> None:
    path = tmp_path / "bg.db"
    with _server(tiny_model_dir, str(path), usage_flush_interval=0.05) as server:
        usage = asyncio.run(_single(server.url))
        deadline = time.monotonic() + 10
        while True:  # read by another connection, as a crash would leave the file
            with sqlite3.connect(path) as conn:
                rows = conn.execute(
                    "SELECT key_id, user, model, prompt_tokens, cached_prompt_tokens, "
                    "completion_tokens FROM usage"
                ).fetchall()
            if rows:
                break
            assert time.monotonic() < deadline, "nothing was flushed"
            time.sleep(0.02)
        assert rows == [(ID_A, "dave", MODEL_NAME, usage["prompt_tokens"], 0, 8)]
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def _single(url: str) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await _completion(client, KEY_A, "one request", "dave", ignore_eos=True)


def test_user_field_is_capped(tiny_model_dir, tmp_path) -> None:
    with _server(tiny_model_dir, str(tmp_path / "cap.db")) as server:
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, "user": "u" * 257}
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(KEY_A))
        assert r.status_code == 400 and r.json()["error"]["param"] == "user"
        assert _report(server.url, ADMIN)["total"]["requests"] == 0


def _start_cli(model_dir, tmp_path, db, flush_interval: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "tokenmill.cli", "serve", str(model_dir), "--port", str(port),
        "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--served-model-name", MODEL_NAME,
        "--log-stats-interval", "0", "--api-key", KEY_A, "--admin-api-key", ADMIN,
        "--usage-db", str(db), "--usage-flush-interval", str(flush_interval),
        "--price-input-per-million", "0.1", "--price-output-per-million", "0.4",
        "--shutdown-timeout", "0",
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.1)


def _db_rows(db) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT key_id, user, prompt_tokens, completion_tokens, cost_usd FROM usage"
        ).fetchall()


@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_sigterm_loses_nothing_and_sigkill_at_most_a_flush_interval(
    tiny_model_dir, tmp_path
) -> None:
    db = tmp_path / "usage.db"
    # A flush interval longer than the test: only the shutdown's flush writes.
    proc, url = _start_cli(tiny_model_dir("llama"), tmp_path, db, flush_interval=3600)
    try:
        usages = [asyncio.run(_single(url)) for _ in range(2)]
        assert _db_rows(db) == []  # not flushed yet
        # A stream still running at the SIGTERM is aborted by the shutdown: not metered.
        body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 240, "ignore_eos": True,
                "stream": True}  # fmt: skip
        events = []
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=_auth(KEY_A), timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)
        assert json.loads(events[-2])["error"]["code"] == "aborted"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cost = TokenPrices(0.1, 0.4).cost(usages[0]["prompt_tokens"], 8)
    assert _db_rows(db) == [(ID_A, "dave", usages[0]["prompt_tokens"], 8, cost)] * 2

    # SIGKILL: what was flushed (a short interval ago) is kept, in the same file.
    proc, url = _start_cli(tiny_model_dir("llama"), tmp_path, db, flush_interval=0.1)
    try:
        asyncio.run(_single(url))
        time.sleep(0.5)  # several flush intervals
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(_db_rows(db)) == 3


def test_a_server_without_keys_meters_under_none(tiny_model_dir) -> None:
    with running_server(tiny_model_dir("llama"), rate_limit_rpm=1) as server:
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
        # Everyone is one caller: the limit applies to all of them together.
        r = httpx.post(f"{server.url}/v1/completions", json=body)
        assert r.status_code == 429 and "Retry-After" in r.headers
        r = httpx.get(f"{server.url}/v1/usage", params={"group_by": "key"})
        assert r.status_code == 200
        (row,) = r.json()["data"]
        assert (row["key_id"], row["requests"], row["completion_tokens"]) == ("none", 1, 3)
