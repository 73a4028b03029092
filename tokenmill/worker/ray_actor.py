"""One tensor-parallel rank as a Ray actor (the Ray executor's worker side, issue 25).

The executor (executor/ray_executor.py) makes this class a Ray actor, one per rank, each in
its own bundle of a placement group. Every rank, rank 0 included, runs the same code as a
process of the multiprocess executor (worker/distributed.py): ``init_distributed`` at rank 0's
node address, then a ``Worker`` of its shard. The executor calls its methods remotely:

    address()            -> (node IP, free port)   rank 0 only: where the group meets
    start(args, host, port) -> WorkerInfo          every rank at once (the group's rendezvous)
    call(method, *args)  -> rank 0's result        every rank: Worker.method(*args), e.g.
                                                   ("execute", SchedulerOutput); others None

This module imports no Ray: it is a plain class, so it stays importable (and testable)
without it; Ray pickles it by reference to its module on each node.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from tokenmill.memory import settle_heap

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs, WorkerInfo
    from tokenmill.worker.worker import Worker


class RankActor:
    """Rank ``rank`` of ``size``; ``device`` is "cpu" or "cuda" (Ray shows the actor only its
    own GPU, so on CUDA every rank is cuda:0 in its process)."""

    def __init__(self, rank: int, size: int, device: str) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.worker: Worker | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: rank 0's store for the group's rendezvous."""
        import ray

        from tokenmill.worker.distributed import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def node(self) -> tuple[str, int]:
        """(node IP, pid), to name this rank in errors."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def start(self, args: EngineArgs, host: str, port: int) -> WorkerInfo:
        """Join the group (blocks until every rank has called this) and load the shard."""
        from tokenmill.worker.distributed import init_distributed
        from tokenmill.worker.worker import Worker, resolve_worker_config

        device = "cuda:0" if self.device == "cuda" else "cpu"
        args = dataclasses.replace(args, device=device)
        if self.size > 1:
            init_distributed(self.rank, self.size, port, device, host=host)
        self.worker = Worker(resolve_worker_config(args, tp_rank=self.rank))
        settle_heap()  # the actor's process is the rank's: what loading made lives as long as it
        return self.worker.info

    def call(self, method: str, *args: Any) -> Any:
        """The executor's ``collective_rpc`` on this rank: rank 0's result; the others' are
        the same or unused, and not sent back."""
        from tokenmill.worker.worker import call_worker

        out = call_worker(self._worker, method, args)
        return out if self.rank == 0 else None

    def stop(self) -> None:
        """Leave the group and drop the model (the executor kills the actor right after)."""
        from tokenmill.worker.distributed import destroy_distributed

        self.worker = None
        destroy_distributed()

    @property
    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank} has not started or was stopped")
        return self.worker
