"""ServerConfig: what `tokenmill serve` adds to the engine arguments (address, keys, caps,
usage metering and prices)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.cost import TokenPrices


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings; every cap answers a request beyond it with a 400 / 413 / 429.

    Args:
        served_model_name: the name clients send as ``model`` (and /v1/models lists).
        api_keys: accepted keys; empty means no authentication.
        max_queue: requests that may wait for a running slot beyond the engine's
            ``max_num_seqs``; more get 429. None: no limit.
        max_n: the largest ``n`` (completions per prompt).
        max_tokens: the largest ``max_tokens``; None: the model's context length.
        max_stop: the most stop strings in one request.
        max_prompts: the most prompts in one /v1/completions request.
        max_body_bytes: request bodies above this get 413.
        shutdown_timeout: seconds in-flight requests may run after SIGTERM before being aborted.
        log_stats_interval: seconds between throughput log lines; 0 disables them.
        tool_call_parser: how tool calls are read from the model's text (server/tools.py:
            hermes, llama3_json, mistral); None: picked from the chat template.
        admin_api_key: a key that may also read every key's usage (/v1/usage) and reset the
            prefix cache; it is accepted wherever a user key is.
        usage_db: SQLite file the per-key usage is kept in across restarts; None: in memory.
        usage_flush_interval: seconds between the batched writes of usage to ``usage_db``
            (what a SIGKILL may lose; SIGTERM loses nothing).
        prices: USD per million prompt / cached prompt / completion tokens, for usage cost.
        price_per_hour: USD an hour of this machine costs, for the dashboard's cost per
            million tokens; None: that cost comes from ``prices`` alone.
        rate_limit_rpm: requests a key may start in any 60 s; more get 429. None: no limit.
        rate_limit_tpm: tokens (prompt + completion) a key may use in any 60 s; a key over it
            gets 429 until enough fall out of the window. None: no limit.
        stats_window: seconds of the sliding window of the dashboard's rates and percentiles.
        metrics_public: /metrics answers without a key (for a Prometheus scraper that sends
            none); by default it needs one like every route but /health.
    """

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_queue: int | None = 1024
    max_n: int = 16
    max_tokens: int | None = None
    max_stop: int = 16
    max_prompts: int = 64
    max_body_bytes: int = 4 * 2**20
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0
    access_log: bool = False
    tool_call_parser: str | None = None
    admin_api_key: str | None = None
    usage_db: str | None = None
    usage_flush_interval: float = 1.0
    prices: TokenPrices = field(default_factory=TokenPrices)
    price_per_hour: float | None = None
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None
    stats_window: float = 60.0
    metrics_public: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if any(not key for key in self.api_keys):
            raise ValueError("api keys must not be empty strings")
        if self.admin_api_key is not None:
            if not self.admin_api_key:
                raise ValueError("the admin api key must not be an empty string")
            if self.admin_api_key in self.api_keys:
                raise ValueError("the admin api key must differ from every user api key")
        if self.usage_flush_interval <= 0:
            raise ValueError(f"usage_flush_interval must be > 0; got {self.usage_flush_interval}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"price_per_hour must be >= 0; got {self.price_per_hour}")
        for name in ("rate_limit_rpm", "rate_limit_tpm"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if self.stats_window <= 0:
            raise ValueError(f"stats_window must be > 0; got {self.stats_window}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0; got {self.max_queue}")
        for name in ("max_n", "max_stop", "max_prompts", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0; got {self.shutdown_timeout}")
        if self.log_stats_interval < 0:
            raise ValueError(f"log_stats_interval must be >= 0; got {self.log_stats_interval}")
