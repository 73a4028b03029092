"""Executor's default launch / collect: an executor without async scheduling (its ranks run
elsewhere) runs each launched step whole, and collect hands the outputs back in launch order."""

from __future__ import annotations

from tokenmill.config import CacheConfig, WorkerInfo
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor


class CountingExecutor(Executor):
    """Answers each step with its number as the one request's token."""

    def __init__(self) -> None:
        self.executed: list[int] = []
        self.cache_config: CacheConfig | None = None
        self.closed = False

    @property
    def info(self) -> WorkerInfo:
        raise AssertionError("launch / collect must not need the worker's info")

    def initialize(self, cache_config: CacheConfig) -> None:
        self.cache_config = cache_config

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        self.executed.append(len(self.executed))
        return RunnerOutput(sampled_token_ids={"r": [self.executed[-1]]})

    def router_stats(self) -> None:
        return None

    def shutdown(self) -> None:
        self.closed = True


def step(n: int) -> SchedulerOutput:
    return SchedulerOutput(new_reqs=[], cached_reqs=[], num_scheduled_tokens={"r": n})


def test_default_launch_runs_the_step_and_collect_returns_outputs_in_order():
    executor = CountingExecutor()
    executor.launch(step(1))
    assert executor.executed == [0]  # run at launch, whole
    executor.launch(step(1))
    assert executor.collect().sampled_token_ids == {"r": [0]}
    assert executor.collect().sampled_token_ids == {"r": [1]}
    executor.launch(step(1))
    assert executor.collect().sampled_token_ids == {"r": [2]}
    executor.shutdown()
    assert executor.closed
