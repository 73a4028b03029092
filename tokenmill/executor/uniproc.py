"""The in-process executor: one worker, called directly, in the engine's thread."""

from __future__ import annotations

from tokenmill.config import CacheConfig, EngineArgs, WorkerInfo
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        self.worker: Worker | None = Worker(args)

    @property
    def info(self) -> WorkerInfo:
        return self._worker.info

    def initialize(self, cache_config: CacheConfig) -> None:
        self._worker.initialize(cache_config)

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        return self._worker.execute(sched_out)

    def launch(self, sched_out: SchedulerOutput) -> None:
        self._worker.launch(sched_out)

    def collect(self) -> RunnerOutput:
        return self._worker.collect()

    def router_stats(self) -> dict[int, tuple[int, ...]] | None:
        return self._worker.router_stats()

    def shutdown(self) -> None:
        self.worker = None

    @property
    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker
