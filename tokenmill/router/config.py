"""The router's settings (``tokenmill router`` flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """replica_urls: base URLs of tokenmill servers (``http://host:port``).

    api_keys: keys the router itself accepts (empty: none needed); the client's
    ``Authorization`` / ``X-Api-Key`` headers are forwarded either way, so replicas check
    their own keys. metrics_public: /metrics needs no key (for a scraper that sends none).
    health_interval: seconds between health checks of every replica.
    """

    replica_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    metrics_public: bool = False
    health_interval: float = 2.0
    max_body_bytes: int = 32 * 2**20
    access_log: bool = False

    def __post_init__(self) -> None:
        if not self.replica_urls:
            raise ValueError("the router needs at least one --replica URL")
        for url in self.replica_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica must be an http(s):// URL; got {url!r}")
        if len(set(u.rstrip("/") for u in self.replica_urls)) != len(self.replica_urls):
            raise ValueError("--replica URLs must be distinct")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.health_interval <= 0:
            raise ValueError(f"health_interval must be > 0; got {self.health_interval}")
