"""The torchrun executor: rank 0's side of an engine whose ranks torchrun started (issue 25).

Under ``torchrun -m tokenmill.worker.torchrun`` rank 0 runs the CLI with
``distributed_executor="torchrun"``; this executor holds rank 0's Worker in the engine's
process, as MultiProcExecutor does, but starts no process: it publishes the engine's
arguments in torchrun's store for ranks 1..N-1 (worker/torchrun.py), joins their group, and
broadcasts each message over a gloo control group. Rank 0's RunnerOutput is the step's.

There is no per-step answer from the other ranks: a rank that fails exits, which fails rank
0's next collective (a TensorParallelWorkerError here), and torchrun stops the rest.
"""

from __future__ import annotations

import atexit
import contextlib
from typing import Any

from tokenmill.config import EngineArgs, WorkerInfo
from tokenmill.executor.base import STEP_TIMEOUT_S, Executor
from tokenmill.executor.multiproc import TensorParallelWorkerError
from tokenmill.worker.distributed import destroy_distributed, free_port
from tokenmill.worker.torchrun import LaunchEnv, join, local_args, publish_args, send, store
from tokenmill.worker.worker import (
    Worker,
    call_worker,
    check_tensor_parallel_args,
    resolve_worker_config,
)


class TorchrunExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        env = LaunchEnv.from_environ()
        if env.rank != 0:
            raise ValueError(f"the engine runs on torchrun's rank 0; this is rank {env.rank}")
        if args.tensor_parallel_size != env.world_size:
            raise ValueError(
                f"tensor_parallel_size {args.tensor_parallel_size} must be torchrun's world "
                f"size {env.world_size} (one rank a process)"
            )
        if env.world_size > 1:
            check_tensor_parallel_args(args)
        self.size = env.world_size
        self.worker: Worker | None = None
        self.control: Any = None
        args = local_args(args, env)
        port = free_port("")
        publish_args(store(env), args, port)
        try:
            self.control = join(env, args, port)
            self.worker = Worker(resolve_worker_config(args))
        except BaseException:
            self.shutdown()
            raise
        # NOTE: the CLI's generate leaves its engine to the interpreter's exit: the other ranks
        # still need their "shutdown" then, or they would exit on a broken connection.
        atexit.register(self.shutdown)

    @property
    def info(self) -> WorkerInfo:
        return self._worker.info

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> Any:
        """Broadcast the call, then make it here. No rank answers: one that fails exits, and
        its closed sockets fail this rank's next collective (torchrun stops the rest)."""
        worker = self._worker
        try:
            send(self.control, method, args)
            return call_worker(worker, method, args)
        except Exception as e:
            raise TensorParallelWorkerError(
                f"tensor-parallel {method} failed on torchrun's rank 0 (a rank that died fails "
                f"the others' collectives): {e}"
            ) from e

    def shutdown(self) -> None:
        if self.control is not None:
            with contextlib.suppress(Exception):
                send(self.control, "shutdown", ())
        self.control, self.worker = None, None
        destroy_distributed()

    @property
    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the executor was shut down")
        return self.worker
