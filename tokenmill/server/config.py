"""ServerConfig: what `tokenmill serve` adds to the engine arguments (address, keys, caps)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if any(not key for key in self.api_keys):
            raise ValueError("api keys must not be empty strings")
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
