"""The router's live state: each replica's health and load, and the routing counts."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from tokenmill.router.policy import Decision, Reason, ReplicaView, choose

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Replica:
    """One upstream tokenmill server. ``healthy`` starts False until its first health check."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    num_requests: int = 0  # attempts sent to it, retries included
    num_failures: int = 0  # attempts that failed before the response was passed on
    last_error: str | None = None
    exit_status: int | None = None  # a launched replica's process has exited

    def view(self) -> ReplicaView:
        return ReplicaView(self.url, self.healthy, self.in_flight)


@dataclass(slots=True)
class ReplicaSet:
    """The replicas behind the router, in ``--replica`` order."""

    replicas: list[Replica]
    decisions: Counter[Reason] = field(default_factory=Counter)

    @classmethod
    def from_urls(cls, urls: list[str]) -> ReplicaSet:
        return cls([Replica(url.rstrip("/")) for url in urls])

    def __getitem__(self, idx: int) -> Replica:
        return self.replicas[idx]

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def num_healthy(self) -> int:
        return sum(r.healthy for r in self.replicas)

    def choose(self, key: str | None, exclude: list[int]) -> Decision | None:
        """Pick a replica (``exclude``: those this request already tried) and count why."""
        decision = choose(key, [r.view() for r in self.replicas], exclude)
        if decision is not None and exclude:
            decision = Decision(decision.replica_idx, Reason.RETRY)
        return decision

    def mark_up(self, idx: int) -> None:
        replica = self.replicas[idx]
        if not replica.healthy:
            logger.info("replica %s is up", replica.url)
        replica.healthy = True
        replica.last_error = None

    def mark_down(self, idx: int, why: str) -> None:
        replica = self.replicas[idx]
        if replica.healthy:
            logger.warning("replica %s is down: %s", replica.url, why)
        replica.healthy = False
        replica.last_error = why

    def status(self) -> list[dict[str, object]]:
        """Each replica as /health shows it."""
        out = []
        for r in self.replicas:
            item: dict[str, object] = {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight}
            if r.last_error is not None:
                item["error"] = r.last_error
            if r.exit_status is not None:
                item["exit_status"] = r.exit_status
            out.append(item)
        return out
