"""Data parallelism: a prefix-aware router in front of tokenmill replicas.

``tokenmill router --replica URL ...`` proxies the OpenAI (and Ollama) routes to replicas,
sending requests that share a prompt prefix to the same one (policy.py), with health checks
(health.py), a retry before the first token (proxy.py) and its own /metrics (metrics.py);
``tokenmill serve --data-parallel-size N`` launches N local replicas behind it (launcher.py).
No torch and no engine here: the router is a light process.
"""

from __future__ import annotations

from tokenmill.router.config import RouterConfig

__all__ = ["RouterConfig"]
