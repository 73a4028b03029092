"""The host's settings: ``tokenmill serve`` without a model (its flags, and the rest of its
arguments, which every runner gets)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostConfig:
    """runner_args: the ``serve`` arguments each runner starts with (keys, engine flags),
    before its model, address and name. max_loaded_models: runners at once. memory_budget:
    bytes the loaded models may take (their processes' resident memory; a model about to load
    counts its file's estimate). keep_alive: seconds an idle model stays loaded when a request
    names none (None: forever). kv_cache_memory: each runner's KV cache, in bytes (a runner's
    own default would take a share of whatever memory is free when it loads).
    """

    runner_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    admin_api_key: str | None = None  # creating a model with a TEMPLATE takes it
    default_model: str = "smollm2-135m-instruct"
    max_loaded_models: int = 3
    memory_budget: int = 8 * 2**30
    keep_alive: float | None = 300.0
    kv_cache_memory: int = 512 * 2**20
    load_timeout: float = 600.0
    stop_timeout: float = 45.0
    max_body_bytes: int = 32 * 2**20
    metrics_public: bool = False
    access_log: bool = False

    def __post_init__(self) -> None:
        if self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1; got {self.max_loaded_models}")
        if self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0; got {self.memory_budget}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535]; got {self.port}")
