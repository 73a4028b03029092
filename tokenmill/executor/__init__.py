"""Executors: how the engine reaches its workers (executor/base.py says what they promise).

Implementations are imported when created, so ``import tokenmill.executor`` pulls in no torch.
"""

from __future__ import annotations

from tokenmill.config import EngineArgs
from tokenmill.executor.base import Executor

__all__ = ["EXECUTORS", "Executor", "create_executor"]

# name -> "module:class", imported on first use (so Ray is imported only when picked).
EXECUTORS = {
    "uniproc": "tokenmill.executor.uniproc:UniProcExecutor",
    "multiproc": "tokenmill.executor.multiproc:MultiProcExecutor",
    "ray": "tokenmill.executor.ray_executor:RayExecutor",
    "torchrun": "tokenmill.executor.torchrun:TorchrunExecutor",
}


def create_executor(args: EngineArgs, name: str | None = None) -> Executor:
    """The executor ``name`` with its workers loaded from ``args``; None picks one by
    ``args.distributed_executor`` and ``args.tensor_parallel_size``: "ray" a Ray actor per
    rank (even for 1: the worker placed on the cluster); "torchrun" rank 0 of torchrun's
    processes; "mp" in-process for 1, a process per rank above."""
    import importlib

    if name is None:
        if args.distributed_executor in ("ray", "torchrun"):
            name = args.distributed_executor
        else:
            name = "multiproc" if args.tensor_parallel_size > 1 else "uniproc"

    if name not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}; got {name!r}")
    module_name, _, cls_name = EXECUTORS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(args)
