"""The pool's rules without a server: room is made by stopping the least recently used idle
runner, by count and by memory; a leased runner is never stopped; a model that cannot fit is
a 503 that names the numbers; keep_alive expiry and 0; names with Ollama's tag."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tokenmill.catalog import Entry
from tokenmill.host.config import HostConfig
from tokenmill.host.pool import HostError, Runner, RunnerPool

MiB = 2**20


def _pool(budget_mib: int = 1000, max_loaded: int = 5) -> tuple[RunnerPool, list[float]]:
    now = [100.0]
    config = HostConfig(memory_budget=budget_mib * MiB, max_loaded_models=max_loaded,
                        keep_alive=10.0)  # fmt: skip
    entries = [Entry(name, Path(f"/models/{name}"), None) for name in ("a", "b", "c", "d")]
    return RunnerPool(config, None, lambda: entries, clock=lambda: now[0]), now  # type: ignore[arg-type]


def _runner(pool: RunnerPool, name: str, mib: int, last_used: float, leases: int = 0) -> Runner:
    # An exited process: its resident memory reads as the runner's estimate.
    process = subprocess.Popen(["true"])
    process.wait()
    runner = Runner(name, mib * MiB, 0, process, None, leases=leases, last_used=last_used)  # type: ignore[arg-type]
    pool.runners[name] = runner
    return runner


def test_room_by_memory_stops_the_least_recently_used_idle_runner() -> None:
    pool, _ = _pool(budget_mib=1000)
    _runner(pool, "a", 400, last_used=1.0)
    _runner(pool, "b", 400, last_used=2.0)
    asyncio.run(pool._make_room("c", 400 * MiB))
    assert sorted(pool.runners) == ["b"]


def test_room_by_count_and_never_a_leased_runner() -> None:
    pool, _ = _pool(max_loaded=2)
    _runner(pool, "a", 10, last_used=1.0, leases=1)  # oldest, but a stream is in flight
    _runner(pool, "b", 10, last_used=2.0)
    pool._loading["c"] = None  # type: ignore[assignment]  # the load that asks counts itself
    asyncio.run(pool._make_room("c", 10 * MiB))
    assert sorted(pool.runners) == ["a"]


def test_no_room_is_a_503_naming_the_numbers() -> None:
    pool, _ = _pool(budget_mib=1000)
    _runner(pool, "a", 600, last_used=1.0, leases=1)
    with pytest.raises(HostError) as exc:
        asyncio.run(pool._make_room("b", 600 * MiB))
    assert exc.value.status == 503 and "600.0 MiB" in exc.value.message
    assert "1000.0 MiB budget" in exc.value.message and "in flight" in exc.value.message
    with pytest.raises(HostError) as exc:
        asyncio.run(pool._make_room("b", 2000 * MiB))
    assert exc.value.status == 503 and "--memory-budget" in exc.value.message


def test_keep_alive_expiry_and_names() -> None:
    pool, now = _pool()
    a = _runner(pool, "a", 10, last_used=1.0, leases=1)
    pool.release(a, 10.0)
    assert a.expires == 110.0
    now[0] = 109.0
    asyncio.run(pool.reap())  # the exited process is forgotten, with an error logged
    assert "a" not in pool.runners
    b = _runner(pool, "b", 10, last_used=1.0, leases=1)
    pool.release(b, None)
    assert b.expires is None
    assert pool.find("b:latest").name == "b"
    with pytest.raises(HostError) as exc:
        pool.find("zzz")
    assert exc.value.status == 404 and "a, b, c, d" in exc.value.message
    with pytest.raises(HostError) as exc:
        pool.find(None)  # the default model, which this directory lacks
    assert "smollm2-135m-instruct" in exc.value.message
