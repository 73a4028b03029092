"""ServerConfig: what `tokenmill serve` adds to the engine arguments (address, keys, caps,
usage metering and prices)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import check_declared, option
from tokenmill.cost import TokenPrices
from tokenmill.recipes import Recipe

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # server/tools.py


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
        max_embedding_inputs: the most inputs in one /v1/embeddings or /api/embed request.
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
        responses_store_size: the most /v1/responses responses kept (in memory) for
            ``previous_response_id`` and GET; the oldest go first. 0 keeps none.
        responses_ttl: seconds a stored response is kept.
        metrics_public: /metrics answers without a key (for a Prometheus scraper that sends
            none); by default it needs one like every route but /health.
    """

    # Declared with option(): `tokenmill serve` makes a flag of each (cli.py); the others
    # (served_model_name, api_keys, max_queue, prices, stats_window) have flags of their own
    # shape or none.
    served_model_name: str
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8000, "port", low=0, high=65535)
    api_keys: tuple[str, ...] = ()
    max_queue: int | None = 1024
    max_n: int = option(16, "largest n", low=1)
    max_tokens: int | None = option(
        None,
        "largest max_tokens a request may ask for (default: the context length)",
        low=1,
        flag="--max-tokens-limit",
    )
    max_stop: int = option(16, "most stop strings", low=1)
    max_prompts: int = option(64, "most prompts in one /v1/completions request", low=1)
    max_embedding_inputs: int = option(
        1024, "most inputs in one /v1/embeddings or /api/embed request", low=1
    )
    max_body_bytes: int = option(4 * 2**20, "larger request bodies get 413", low=1)
    shutdown_timeout: float = option(
        30.0, "seconds in-flight requests may run after SIGTERM before they are aborted", low=0
    )
    log_stats_interval: float = option(10.0, "seconds between throughput log lines, 0: none", low=0)
    access_log: bool = option(False, "log every HTTP request")
    tool_call_parser: str | None = option(
        None,
        "format of the model's tool calls (default: from its chat template, else hermes)",
        choices=TOOL_CALL_PARSERS,
    )
    admin_api_key: str | None = option(
        None,
        "a key that also reads every key's usage (/v1/usage) and resets the prefix cache "
        "(default: none)",
    )
    usage_db: str | None = option(
        None,
        "SQLite file that keeps per-key usage across restarts (default: in memory)",
        metavar="PATH",
    )
    usage_flush_interval: float = option(
        1.0, "seconds between batched usage writes: what a SIGKILL may lose"
    )
    prices: TokenPrices = field(default_factory=TokenPrices)
    price_per_hour: float | None = option(
        None,
        "USD an hour of this machine, for the dashboard's cost per million tokens (default: none)",
        low=0,
    )
    rate_limit_rpm: int | None = option(
        None, "requests a key may start a minute; more get 429 (default: no limit)", low=1
    )
    rate_limit_tpm: int | None = option(
        None, "tokens a key may use a minute; beyond, 429 (default: no limit)", low=1
    )
    stats_window: float = 60.0
    responses_store_size: int = option(
        1024, "most /v1/responses kept for previous_response_id, 0: none (in memory)", low=0
    )
    responses_ttl: float = option(3600.0, "seconds a stored /v1/responses response is kept", low=0)
    # A model made from a Modelfile (recipes.py): its SYSTEM, MESSAGEs and PARAMETERs apply
    # to every request (its TEMPLATE is the engine's chat template).
    recipe: Recipe | None = None
    metrics_public: bool = option(
        False,
        "serve /metrics without an API key, for a scraper that sends none "
        "(default: it needs one, as every route but /health)",
    )

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
        check_declared(self)
        if self.usage_flush_interval <= 0:
            raise ValueError(f"usage_flush_interval must be > 0; got {self.usage_flush_interval}")
        if self.stats_window <= 0:
            raise ValueError(f"stats_window must be > 0; got {self.stats_window}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0; got {self.max_queue}")
