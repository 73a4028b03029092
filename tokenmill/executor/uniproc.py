"""The in-process executor: one worker, called directly, in the engine's thread."""

from __future__ import annotations

from typing import Any

from tokenmill.config import EngineArgs, WorkerInfo
from tokenmill.executor.base import STEP_TIMEOUT_S, Executor
from tokenmill.worker.worker import Worker, call_worker, resolve_worker_config


class UniProcExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        self.worker: Worker | None = Worker(resolve_worker_config(args))

    @property
    def info(self) -> WorkerInfo:
        return self._worker.info

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> Any:
        return call_worker(self._worker, method, args)

    def shutdown(self) -> None:
        self.worker = None

    @property
    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker
