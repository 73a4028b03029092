"""The multiprocess executor: one Worker per tensor-parallel rank (issue 25).

Rank 0 is a Worker in the engine's process; ranks 1..N-1 are ``python -m
tokenmill.worker.distributed`` subprocesses (a fresh interpreter each: no fork of a process
holding threads, and no re-import of the user's script as spawn does). The scheduler runs once,
in the engine; each step's SchedulerOutput is pickled once and sent to every rank over its own
connection (multiprocessing.connection on loopback, authenticated by a per-executor key),
every rank runs its shard of the model (the layers' all-reduces and the logits' all-gather
pair the ranks up through torch.distributed), and rank 0's RunnerOutput is the step's.

    engine --(method, args)--> rank 1..N-1 (conn)   rank 0 (in process)
                                 \\______ torch.distributed collectives ______/
    engine <--rank 0's result--;  <--("ok")-- each other rank

(``collective_rpc``: every step is ("execute", (SchedulerOutput,)); worker/distributed.py runs
the ranks' side.) With async scheduling (on with CUDA) a step is ("launch", ...) and later
("collect", ()) instead (executor/base.py): every rank queues the step on its device and
answers at once, and the engine schedules the next step while they run; the collectives pair
up on the devices' streams in the order the ranks queued them, the same on every rank.

A rank that dies or fails makes ``execute`` raise TensorParallelWorkerError within a few
seconds: every wait polls the rank processes' liveness, and a dead peer's closed socket fails
rank 0's next collective at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Listener
from multiprocessing.reduction import ForkingPickler
from typing import Any

from tokenmill.config import EngineArgs, WorkerInfo
from tokenmill.executor.base import START_TIMEOUT_S, STEP_TIMEOUT_S, Executor, accept_child
from tokenmill.worker.distributed import (
    ADDRESS_ENV,
    AUTHKEY_ENV,
    destroy_distributed,
    free_port,
    init_distributed,
    rank_args,
)
from tokenmill.worker.worker import (
    Worker,
    call_worker,
    check_tensor_parallel_args,
    resolve_worker_config,
)

_POLL_S = 0.05
# How long rank 0 waits, after its collective failed, for the rank that broke it to be seen dead.
_DEATH_GRACE_S = 3.0


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot go on."""


class MultiProcExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        check_tensor_parallel_args(args)  # a ValueError before any process starts
        self.size = args.tensor_parallel_size
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self.worker: Worker | None = None
        port = free_port()
        authkey = secrets.token_bytes(16)
        try:
            with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
                host, listen_port = listener.address
                env = {**os.environ, ADDRESS_ENV: f"{host}:{listen_port}"}
                env[AUTHKEY_ENV] = authkey.hex()
                for rank in range(1, self.size):
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "tokenmill.worker.distributed"], env=env
                        )
                    )
                    conn = _accept(listener, self.procs[-1], rank)
                    conn.send((args, rank, port))
                    self.conns.append(conn)
            init_distributed(0, self.size, port, rank_args(args, 0).device)
            self.worker = Worker(resolve_worker_config(rank_args(args, 0)))
            self._wait_all(START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def info(self) -> WorkerInfo:
        return self._worker.info

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> Any:
        worker = self._worker
        self._broadcast(method, args)
        out = self._run(worker, method, args)
        self._wait_all(timeout)
        return out

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("shutdown", ()))
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns, self.worker = [], [], None
        destroy_distributed()

    @property
    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker

    def _broadcast(self, method: str, args: tuple[Any, ...]) -> None:
        message = ForkingPickler.dumps((method, args))  # once for every rank (each recv()s it)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(message)
            except OSError as e:
                raise self._rank_error(rank, "its connection broke") from e

    def _run(self, worker: Worker, method: str, args: tuple[Any, ...]) -> Any:
        """Rank 0's part; a failure is blamed on a dead rank when one has died."""
        try:
            return call_worker(worker, method, args)
        except Exception as e:
            # NOTE: a killed peer's socket closes before its exit status can be read: a
            # collective fails first, so wait a moment for the status.
            deadline = time.monotonic() + _DEATH_GRACE_S
            while (dead := self._first_dead()) is None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            if dead is not None:
                raise self._rank_error(dead, "it exited") from e
            raise

    def _wait_all(self, timeout: float) -> None:
        """Every other rank's ("ok"); TensorParallelWorkerError if one dies, fails or is
        silent past ``timeout``."""
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.conns, start=1):
            proc = self.procs[rank - 1]
            while not conn.poll(_POLL_S):
                if proc.poll() is not None:
                    raise self._rank_error(rank, "it exited")
                if time.monotonic() > deadline:
                    raise self._rank_error(rank, f"it did not answer within {timeout:.0f} s")
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError) as e:
                raise self._rank_error(rank, "its connection closed") from e
            if kind == "error":
                raise self._rank_error(rank, f"it failed:\n{payload}")

    def _first_dead(self) -> int | None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return rank
        return None

    def _rank_error(self, rank: int, what: str) -> TensorParallelWorkerError:
        proc = self.procs[rank - 1]
        code = proc.poll()
        status = f", exit code {code}" if code is not None else ""
        return TensorParallelWorkerError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}{status}) stopped the engine: "
            f"{what}"
        )


def _accept(listener: Listener, proc: subprocess.Popen[bytes], rank: int) -> Connection:
    """The connection of the rank process just started (it fails the start if it exits)."""
    conn = accept_child(listener, proc)
    if conn is None:
        raise TensorParallelWorkerError(
            f"tensor-parallel worker rank {rank} (pid {proc.pid}) did not start "
            f"(exit code {proc.poll()})"
        )
    return conn
