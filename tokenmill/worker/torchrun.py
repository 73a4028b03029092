"""A tensor-parallel engine launched by torchrun (issue 25): one process per rank, started by
torchrun (on one machine or several), instead of by the engine.

    torchrun --nproc-per-node 2 -m tokenmill.worker.torchrun serve MODEL [flags]

Every process runs this module with torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR
/ MASTER_PORT. Rank 0 runs the tokenmill CLI (engine, server) with
``--distributed-executor torchrun --tensor-parallel-size WORLD_SIZE``; its executor
(executor/torchrun.py) holds rank 0's Worker. Ranks 1..N-1 serve that executor's messages
with the same code as the multiprocess executor's rank processes (worker/distributed.py):

    rendezvous        torchrun's store: rank 0 publishes (EngineArgs, port), the others wait
    init_distributed  every rank at MASTER_ADDR:port (gloo on CPU, NCCL on CUDA)
    control group     a gloo group of the same ranks: rank 0 broadcasts each message, a
        (method, args) call of the Worker, then ("shutdown", ()) (distributed.serve_messages)

A rank that fails exits; its closed sockets fail the others' next collective, and torchrun
stops the remaining ranks (its usual policy for a failed worker).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import runpy
import sys
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.config import EngineArgs
from tokenmill.memory import settle_heap
from tokenmill.worker.distributed import destroy_distributed, init_distributed, serve_messages

logger = logging.getLogger(__name__)

_ARGS_KEY = "tokenmill/engine_args"
# How long ranks 1..N-1 wait for rank 0 to publish its arguments (rank 0 parses its flags,
# imports the engine and, for serve, starts its server first).
RENDEZVOUS_TIMEOUT_S = 600.0
# Ranks 1..N-1 wait for the next message as long as the engine idles; a dead rank 0's closed
# socket ends the wait at once.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchEnv:
    """What torchrun tells each process (its environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in names if name not in os.environ]
        if missing:
            raise ValueError(
                f"distributed_executor='torchrun' runs under torchrun ({', '.join(missing)} "
                "unset): torchrun --nproc-per-node N -m tokenmill.worker.torchrun serve MODEL"
            )
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
        )


def local_args(args: EngineArgs, env: LaunchEnv) -> EngineArgs:
    """This process's arguments: on CUDA the device of its local rank."""
    if args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available()):
        return dataclasses.replace(args, device=f"cuda:{env.local_rank}")
    return args


def store(env: LaunchEnv) -> dist.Store:
    """torchrun's key-value store (the agent's, or rank 0's), under tokenmill's prefix."""
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    url = f"env://{env.master_addr}:{env.master_port}"
    base, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=timeout))
    # NOTE: with this set (torchrun sets it) torch's tcp:// rendezvous makes every rank, rank
    # 0 too, a client of the URL's store; init_distributed's group meets at a port rank 0
    # hosts itself, as the multiprocess executor's does.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    return dist.PrefixStore("tokenmill/", base)


def publish_args(kv: dist.Store, args: EngineArgs, port: int) -> None:
    """Rank 0: the engine's arguments and the port of the group's rendezvous."""
    kv.set(_ARGS_KEY, pickle.dumps((args, port)))


def join(env: LaunchEnv, args: EngineArgs, port: int) -> dist.ProcessGroup:
    """Join the tensor-parallel group and the control group; returns the control group."""
    init_distributed(env.rank, env.world_size, port, args.device, host=env.master_addr)
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def send(group: dist.ProcessGroup, method: str, args: tuple[Any, ...]) -> None:
    """Rank 0: one message, a call of the Worker's ``method``, to every other rank."""
    dist.broadcast_object_list([(method, args)], src=0, group=group)


def _receive(group: dist.ProcessGroup) -> tuple[str, tuple[Any, ...]]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def serve_rank(env: LaunchEnv) -> None:
    """Ranks 1..N-1: wait for rank 0's arguments, load this rank's shard, run its messages."""
    from tokenmill.worker.worker import Worker, resolve_worker_config

    kv = store(env)
    args, port = pickle.loads(kv.get(_ARGS_KEY))
    args = local_args(args, env)
    control = join(env, args, port)
    try:
        worker = Worker(resolve_worker_config(args, tp_rank=env.rank))
        settle_heap()  # what loading made lives as long as the rank
        serve_messages(worker, lambda: _receive(control), lambda: None)
    finally:
        destroy_distributed()


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def main() -> int:
    env = LaunchEnv.from_environ()
    if env.rank != 0:
        logging.basicConfig(level=logging.WARNING, format=f"rank {env.rank}: %(message)s")
        serve_rank(env)
        return 0
    argv = sys.argv[1:]
    if not _has_flag(argv, "--tensor-parallel-size"):
        argv += ["--tensor-parallel-size", str(env.world_size)]
    argv += ["--distributed-executor", "torchrun"]
    # NOTE: run as `python -m tokenmill.cli` would be (the CLI is above the worker's level).
    sys.argv = ["tokenmill", *argv]
    try:
        runpy.run_module("tokenmill.cli", run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
