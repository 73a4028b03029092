"""Health checks: GET /health of every replica every ``interval`` seconds.

A replica is up while its /health answers 200 (tokenmill answers 503 while loading, draining
or after an engine failure); a connection error or any other answer marks it down. The proxy
also marks a replica down the moment a request to it fails to connect; the next check that
succeeds brings it back.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from tokenmill.router.replicas import ReplicaSet

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0


async def check_replica(client: httpx.AsyncClient, replicas: ReplicaSet, idx: int) -> bool:
    """One check of replica ``idx``; returns whether it is up."""
    replica = replicas[idx]
    if replica.exit_status is not None:
        replicas.mark_down(idx, f"its process exited with status {replica.exit_status}")
        return False
    try:
        response = await client.get(f"{replica.url}/health", timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError as e:
        replicas.mark_down(idx, f"health check failed: {type(e).__name__}: {e}")
        return False
    if response.status_code == 200:
        replicas.mark_up(idx)
        return True
    status = response.json().get("status", "") if _is_json(response) else ""
    replicas.mark_down(idx, f"/health answered {response.status_code} {status}".rstrip())
    return False


async def check_all(client: httpx.AsyncClient, replicas: ReplicaSet) -> None:
    await asyncio.gather(*(check_replica(client, replicas, i) for i in range(len(replicas))))


async def health_loop(client: httpx.AsyncClient, replicas: ReplicaSet, interval: float) -> None:
    """Check every replica, forever (cancel the task to stop)."""
    while True:
        await check_all(client, replicas)
        await asyncio.sleep(interval)


def _is_json(response: httpx.Response) -> bool:
    try:
        return isinstance(response.json(), dict)
    except ValueError:
        return False
