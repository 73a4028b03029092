"""Executor: the one interface between the engine and the model side.

The engine never touches torch, a model or a KV cache tensor. It builds an executor, reads what
the loaded model offers (``info``), sizes the scheduler from it, hands back the KV plan
(``initialize``), and then only sends steps (``execute``). Behind the interface sit one
in-process worker today; a multiprocess executor (a worker per tensor-parallel rank, the driver
gathering rank 0's output) or one that also drives a draft model fit beside it unchanged.

    engine                       executor                      worker(s)
    create_executor(args)  --->  load on each worker      --->  device, dtype, weights, quant
    info                   <---  WorkerInfo (rank 0)
    initialize(cache)      --->  allocate KV caches       --->  ModelRunner (+ decode graphs)
    execute(sched_out)     --->  run the step             --->  RunnerOutput
    launch(sched_out)      --->  queue the step           --->  (async scheduling:
    collect()              <---  its RunnerOutput         <---   WorkerInfo.async_scheduling)
    collective_rpc(m, ...) --->  every rank's Worker.m    --->  rank 0's result
    shutdown()             --->  release

``initialize``, ``execute``, ``launch`` and ``collect`` are calls of the workers' methods of
those names on every rank (``collective_rpc``), the one thing each executor implements: in the
engine's process, over a connection to each rank process, over torchrun's control group, or as
a Ray actor's call.
"""

from __future__ import annotations

import subprocess
import time
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection, Listener
from typing import Any

from tokenmill.config import CacheConfig, WorkerInfo
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput

# How long the ranks may take to start and load their shards (and allocate their KV caches);
# and to answer one step.
START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 60.0
# How often a start, waiting for a child process to connect, checks that it is still alive.
_ACCEPT_POLL_S = 0.05


def accept_child(listener: Listener, proc: subprocess.Popen[bytes]) -> Connection | None:
    """The connection of a child process just started on ``listener`` (a rank, the engine
    core); None if it exits first or is silent past START_TIMEOUT_S (the caller says which)."""
    listener._listener._socket.settimeout(_ACCEPT_POLL_S)  # type: ignore[attr-defined]
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return listener.accept()
        except TimeoutError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return None


class Executor(ABC):
    """Runs scheduler steps on one or more workers and returns one RunnerOutput a step."""

    @property
    @abstractmethod
    def info(self) -> WorkerInfo:
        """The loaded model and the KV blocks its memory budget allows."""

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> Any:
        """Call ``method`` of every rank's Worker with ``args``, all ranks together (their
        collectives pair them up), and return rank 0's result: the ranks compute the same
        step, so the others' results stay with them. A rank that dies, fails or is silent past
        ``timeout`` seconds raises (executor/multiproc.py: TensorParallelWorkerError)."""

    def initialize(self, cache_config: CacheConfig) -> None:
        """Allocate the KV cache the engine settled on (``cache_config.num_blocks``)."""
        self.collective_rpc("initialize", cache_config, timeout=START_TIMEOUT_S)

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """Run one step: forward pass, logits, sampling."""
        return self.collective_rpc("execute", sched_out)

    def launch(self, sched_out: SchedulerOutput) -> None:
        """Start a step on every rank; ``collect`` returns its output, steps in launch order.
        With ``info.async_scheduling`` each rank queues the step on its device and returns
        before it is done, and the engine schedules the next one meanwhile; else each rank
        runs it whole before it answers."""
        self.collective_rpc("launch", sched_out)

    def collect(self) -> RunnerOutput:
        """The output of the oldest launched step (every rank waits for its own)."""
        return self.collective_rpc("collect")

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (their model and KV cache); the executor is unusable after."""
