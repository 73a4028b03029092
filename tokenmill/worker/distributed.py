"""One tensor-parallel rank's side of the multiprocess executor (issue 25).

Ranks 1..N-1 run ``python -m tokenmill.worker.distributed`` (started by
executor/multiproc.py); rank 0 is a Worker in the engine's process. Each rank joins
torch.distributed's default group (gloo on CPU, NCCL on CUDA) over a loopback TCP port,
loads its shard of the model, then answers the executor's messages on a connection
(``serve_messages``, the rank loop the torchrun executor's ranks run too):

    (method, args)     -> ("ok", None)   Worker.method(*args), e.g. ("execute", (sched_out,)):
                                         the step's collectives pair it with rank 0
    ("shutdown", ())   -> exits
    any failure        -> ("error", traceback text), then exits

Only rank 0's RunnerOutput reaches the engine; the others sample the same tokens from the
same gathered logits and the same seed, so their per-request state stays in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tokenmill.config import EngineArgs
from tokenmill.memory import settle_heap

if TYPE_CHECKING:
    from tokenmill.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long a collective waits for a rank that neither answers nor dies (a dead rank's closed
# socket fails the collective at once).
COLLECTIVE_TIMEOUT_S = 30.0
# Environment variables the executor hands a rank process: where to connect, and the key.
ADDRESS_ENV, AUTHKEY_ENV = "TOKENMILL_TP_ADDRESS", "TOKENMILL_TP_AUTHKEY"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (on ``host``; "" for every interface): where a group's
    rank 0 hosts its rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_distributed(rank: int, size: int, port: int, device: str, host: str = "127.0.0.1") -> None:
    """Join the default process group of ``size`` ranks as ``rank`` (rank 0 hosts the store
    on ``host``:``port``; the Ray executor's ranks meet at rank 0's node address)."""
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel group is already running in this process; shut its engine "
            "down before starting another"
        )
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        # A Ray actor sees only its own GPU (cuda:0); a process of the multiprocess executor
        # every GPU (cuda:<rank>).
        index = torch.device(device).index
        torch.cuda.set_device(rank if index is None else index)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_args(args: EngineArgs, rank: int) -> EngineArgs:
    """Rank ``rank``'s arguments: on CUDA each rank its own device."""
    if args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available()):
        return dataclasses.replace(args, device=f"cuda:{rank}")
    return args


def serve_messages(
    worker: Worker, receive: Callable[[], tuple[str, tuple[Any, ...]]], done: Callable[[], None]
) -> None:
    """A rank's loop (ranks 1..N-1 of the multiprocess and torchrun executors): each message
    from rank 0 is a (method, args) call of this rank's Worker (call_worker), ``done`` after
    it, until ("shutdown", ())."""
    from tokenmill.worker.worker import call_worker

    while True:
        method, args = receive()
        if method == "shutdown":
            return
        call_worker(worker, method, args)
        done()


def serve_rank(conn: Connection, args: EngineArgs, rank: int, port: int) -> None:
    """Load rank ``rank``'s shard and run the executor's messages until shutdown."""
    from tokenmill.worker.worker import Worker, resolve_worker_config

    args = rank_args(args, rank)
    init_distributed(rank, args.tensor_parallel_size, port, args.device)
    try:
        worker = Worker(resolve_worker_config(args, tp_rank=rank))
        settle_heap()  # what loading made lives as long as the rank
        conn.send(("ok", None))
        serve_messages(worker, conn.recv, lambda: conn.send(("ok", None)))
    finally:
        destroy_distributed()


def main() -> int:
    """A rank process: its address and key from the environment, its task from the pipe."""
    logging.basicConfig(level=logging.WARNING, format="tp-rank %(process)d: %(message)s")
    address = os.environ[ADDRESS_ENV].rpartition(":")
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    conn = Client((address[0], int(address[2])), authkey=authkey)
    try:
        args, rank, port = conn.recv()
        serve_rank(conn, args, rank, port)
    except EOFError:  # the engine went away
        return 1
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
