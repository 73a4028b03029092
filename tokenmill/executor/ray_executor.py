"""The Ray executor: one Ray actor per tensor-parallel rank, placed by a placement group
(issue 25), so the ranks may sit on several machines of a Ray cluster.

Every rank, rank 0 included, is an actor (worker/ray_actor.py) running the same Worker code
as the multiprocess executor's rank processes. Rank 0 is an actor rather than the engine's
process so that one layout serves one node and many: the engine may run where there is no
GPU (a cluster's head node), its process holds no torch.distributed group, and every rank
gets its device and CPUs from Ray the same way. The cost is rank 0's RunnerOutput crossing
Ray's object store each step (a few token ids and logprobs).

    engine --ray.put(args)--> call.remote(method, ...) on rank 0..N-1 (actors, a bundle each)
                            \\______ torch.distributed collectives ______/
    engine <--rank 0's result--;  <--None-- each other rank

(``collective_rpc``: every step is ("execute", SchedulerOutput).)

The placement group has one bundle per rank: {"CPU": threads} on CPU, {"GPU": 1} on CUDA;
strategy PACK by default (one node while the ranks fit on it, spread over nodes when they
must). The ranks meet at rank 0's node IP and a port free there (MASTER_ADDR / MASTER_PORT).

A rank that dies or fails makes ``execute`` raise TensorParallelWorkerError within seconds:
every wait is a ``ray.wait`` with a deadline, Ray fails a dead actor's calls as soon as it
sees the process gone, and the dead peer's closed socket fails the other ranks' collective.

``ray`` is imported here only, and this module only when ``distributed_executor="ray"``.
It connects to an existing cluster when RAY_ADDRESS is set (or Ray is already initialized in
this process), else starts a local one sized to this machine and stops it at shutdown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Any

from tokenmill.config import EngineArgs, WorkerInfo
from tokenmill.executor.base import START_TIMEOUT_S, STEP_TIMEOUT_S, Executor
from tokenmill.executor.multiproc import TensorParallelWorkerError
from tokenmill.worker.ray_actor import RankActor
from tokenmill.worker.worker import check_tensor_parallel_args

logger = logging.getLogger(__name__)

# After one rank failed, how long to wait for another to be seen dead (the likelier cause: a
# killed peer fails the survivors' collective before Ray has marked it dead).
_DEATH_GRACE_S = 3.0
# One node while the ranks fit on it (no network between them), several when they must.
PLACEMENT_STRATEGY = "PACK"


class RayExecutor(Executor):
    def __init__(self, args: EngineArgs) -> None:
        if args.tensor_parallel_size > 1:
            check_tensor_parallel_args(args)  # a ValueError before Ray starts anything
        try:
            import ray
        except ImportError as e:
            raise ImportError(
                "distributed_executor='ray' needs Ray: pip install 'tokenmill[ray]'"
            ) from e
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        self.size = args.tensor_parallel_size
        self.actors: list[Any] = []
        self.nodes: list[tuple[str, int] | None] = [None] * self.size
        self.placement_group: Any = None
        self._info: WorkerInfo | None = None
        self._started_ray = False
        self._ray_keeper: threading.Event | None = None
        try:
            self._connect()
            device = self._pick_device(args.device)
            threads = args.num_threads or self._default_threads()
            if device == "cuda":
                bundle, actor_resources = {"GPU": 1}, dict(num_cpus=0, num_gpus=1)
            else:
                bundle, actor_resources = {"CPU": threads}, dict(num_cpus=threads)
                args = dataclasses.replace(args, num_threads=threads)
            self._check_fits(bundle)
            self.placement_group = placement_group(
                [dict(bundle) for _ in range(self.size)], strategy=PLACEMENT_STRATEGY
            )
            try:
                ray.get(self.placement_group.ready(), timeout=START_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise TensorParallelWorkerError(
                    f"Ray could not place {self.size} bundles of {bundle} within "
                    f"{START_TIMEOUT_S:.0f} s (available: {ray.available_resources()})"
                ) from None
            actor_cls = ray.remote(RankActor)
            for rank in range(self.size):
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                )
                self.actors.append(
                    actor_cls.options(
                        scheduling_strategy=strategy, max_restarts=0, **actor_resources
                    ).remote(rank, self.size, device)
                )
            self.nodes = self._gather([a.node.remote() for a in self.actors], START_TIMEOUT_S)
            host, port = self._gather([self.actors[0].address.remote()], START_TIMEOUT_S)[0]
            infos = self._gather(
                [a.start.remote(args, host, port) for a in self.actors], START_TIMEOUT_S
            )
            self._info = infos[0]
            logger.info(
                "Ray executor: %d ranks on %s (rendezvous %s:%d)",
                self.size,
                ", ".join(sorted({ip for ip, _ in self.nodes})),  # type: ignore[misc]
                host,
                port,
            )
        except BaseException:
            self.shutdown()
            raise

    @property
    def info(self) -> WorkerInfo:
        if self._info is None:
            raise RuntimeError("the executor was shut down")
        return self._info

    def collective_rpc(self, method: str, *args: Any, timeout: float = STEP_TIMEOUT_S) -> Any:
        actors = self._live()
        refs = [self._ray.put(a) for a in args]  # pickled once, fetched by every rank
        return self._gather([a.call.remote(method, *refs) for a in actors], timeout)[0]

    def shutdown(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        # NOTE: no graceful stop first: a rank may be stuck in a collective its dead peer
        # never joins; killing frees its device and memory at once.
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                self._remove_placement_group(self.placement_group)
        self.actors, self.placement_group, self._info = [], None, None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        if self._ray_keeper is not None:
            self._ray_keeper.set()
            self._ray_keeper = None

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address="auto")
        else:
            self._ray_keeper = _start_local_ray(ray)
            self._started_ray = True

    def _pick_device(self, device: str) -> str:
        """Every rank's device, cuda or cpu: "auto" is CUDA when the cluster has GPUs (the
        engine's own machine may have none)."""
        if device.startswith("cuda"):
            return "cuda"
        if device == "cpu":
            return "cpu"
        return "cuda" if self._ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"

    def _default_threads(self) -> int:
        """A CPU rank's threads: the largest node's CPUs shared by the ranks (PACK puts them
        on one node when they fit)."""
        node_cpus = [node["Resources"].get("CPU", 0) for node in self._ray.nodes() if node["Alive"]]
        return max(1, int(max(node_cpus, default=1)) // self.size)

    def _check_fits(self, bundle: dict[str, int]) -> None:
        """A ValueError when the whole cluster has too little of a resource (waiting could not
        help unless an autoscaler adds nodes)."""
        total = self._ray.cluster_resources()
        for name, amount in bundle.items():
            if total.get(name, 0) < amount * self.size:
                raise ValueError(
                    f"tensor_parallel_size {self.size} needs {amount * self.size:g} {name} "
                    f"({amount:g} a rank); the Ray cluster has {total.get(name, 0):g}"
                )

    def _live(self) -> list[Any]:
        if not self.actors:
            raise RuntimeError("the executor was shut down")
        return self.actors

    def _gather(self, refs: list[Any], timeout: float) -> list[Any]:
        """Every call's result, in rank order; TensorParallelWorkerError when a rank died,
        failed or was silent past ``timeout``."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                rank = rank_of[pending[0]]
                raise self._rank_error(rank, f"it did not answer within {timeout:.0f} s")
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise self._rank_error(rank, f"its actor died ({_first_line(e)})") from e
                except ray.exceptions.RayTaskError as e:
                    raise self._blame(rank, e, pending, rank_of) from e
        return [results[rank] for rank in range(len(refs))]

    def _blame(
        self, rank: int, error: Exception, pending: list[Any], rank_of: dict[Any, int]
    ) -> TensorParallelWorkerError:
        """The error for a failed call: a rank found dead within a moment is the cause."""
        ray = self._ray
        if pending:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_DEATH_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    return self._rank_error(rank_of[ref], f"its actor died ({_first_line(e)})")
                except Exception:  # another rank failing after it: the first error stands
                    continue
        return self._rank_error(rank, f"it failed:\n{error}")

    def _rank_error(self, rank: int, what: str) -> TensorParallelWorkerError:
        node = self.nodes[rank] if rank < len(self.nodes) else None
        where = f"Ray actor, pid {node[1]} on {node[0]}" if node else "Ray actor"
        return TensorParallelWorkerError(
            f"tensor-parallel worker rank {rank} ({where}) stopped the engine: {what}"
        )


def _start_local_ray(ray: Any) -> threading.Event | None:
    """Start a local Ray cluster (this machine's CPUs and GPUs; "local": never one found on
    the machine, as RAY_ADDRESS is how to name one); off the main thread, from a keeper thread
    that lives until the returned event is set.

    NOTE: Ray starts its node processes (GCS, raylet) with PR_SET_PDEATHSIG, which fires when
    the *thread* that started them exits. The server loads its engine in a thread that ends
    once loaded: a cluster started there would be killed a moment later, and the engine's
    process with it.
    """
    if threading.current_thread() is threading.main_thread():
        ray.init(address="local", include_dashboard=False)
        return None
    started, stop = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def keep() -> None:
        try:
            ray.init(address="local", include_dashboard=False)
        except BaseException as e:
            errors.append(e)
            return
        finally:
            started.set()
        stop.wait()

    threading.Thread(target=keep, name="tokenmill-ray", daemon=True).start()
    started.wait()
    if errors:
        raise errors[0]
    return stop


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
