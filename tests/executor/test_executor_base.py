"""Executor's calls: initialize, execute, launch and collect are calls of the workers' methods
(collective_rpc) on every rank, which queue launched steps (or run them whole, without async
scheduling) and hand their outputs back in launch order."""

from __future__ import annotations

import pytest

from tokenmill.config import CacheConfig, WorkerInfo
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor


class CountingExecutor(Executor):
    """A rank that answers each step with its number as the one request's token; launched
    steps wait in a queue until collected, as a worker's do."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.launched: list[int] = []
        self.calls: list[str] = []
        self.cache_config: CacheConfig | None = None
        self.closed = False

    @property
    def info(self) -> WorkerInfo:
        raise AssertionError("launch / collect must not need the worker's info")

    def collective_rpc(self, method: str, *args: object, timeout: float = 1.0) -> object:
        self.calls.append(method)
        if method == "initialize":
            (self.cache_config,) = args
            return None
        if method == "collect":
            return RunnerOutput(sampled_token_ids={"r": [self.launched.pop(0)]})
        number, self.num_steps = self.num_steps, self.num_steps + 1
        if method == "launch":
            self.launched.append(number)
            return None
        assert method == "execute"
        return RunnerOutput(sampled_token_ids={"r": [number]})

    def shutdown(self) -> None:
        self.closed = True


def step(n: int) -> SchedulerOutput:
    return SchedulerOutput(new_reqs=[], cached_reqs=[], num_scheduled_tokens={"r": n})


def test_launch_and_collect_are_worker_calls_in_launch_order():
    executor = CountingExecutor()
    executor.launch(step(1))
    executor.launch(step(1))
    assert executor.collect().sampled_token_ids == {"r": [0]}
    assert executor.collect().sampled_token_ids == {"r": [1]}
    executor.launch(step(1))
    assert executor.collect().sampled_token_ids == {"r": [2]}
    assert executor.calls == ["launch", "launch", "collect", "collect", "launch", "collect"]
    executor.shutdown()
    assert executor.closed


def test_initialize_and_execute_are_worker_calls():
    executor = CountingExecutor()
    cache = CacheConfig(block_size=16, num_blocks=4)
    executor.initialize(cache)
    assert executor.cache_config is cache
    assert executor.execute(step(1)).sampled_token_ids == {"r": [0]}


def test_a_call_names_a_public_worker_method():
    """What every rank does with a collective_rpc: the Worker's public method of that name."""
    from tokenmill.worker.worker import call_worker

    class Stub:
        def execute(self, x: int) -> int:
            return x + 1

        def _private(self) -> None:
            raise AssertionError("never called")

    assert call_worker(Stub(), "execute", (2,)) == 3
    for name in ("_private", "missing"):
        with pytest.raises(ValueError, match=name):
            call_worker(Stub(), name, ())
