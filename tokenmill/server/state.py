"""ServerState: loading the engine in the background, admission (the queue cap), and draining.

Status moves LOADING -> READY -> STOPPING, or LOADING -> FAILED (or LOADING -> STOPPING when a
shutdown comes first). Only READY serves requests; the others answer 503. Admission counts the
engine requests the server has in flight; the event loop is the only thread that touches it,
so a check and its increment cannot interleave.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import Callable

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import EngineStats
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError

logger = logging.getLogger(__name__)


class ServerStatus(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


class Ticket:
    """Admission of ``num`` engine requests; ``release`` may be called more than once."""

    def __init__(self, state: ServerState, num: int) -> None:
        self._state = state
        self._num = num

    def release(self) -> None:
        if self._num:
            self._state._num_admitted -= self._num
            self._num = 0


class ServerState:
    def __init__(self, config: ServerConfig, load_engine: Callable[[], AsyncEngine]) -> None:
        self.config = config
        self.status = ServerStatus.LOADING
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        # Set when the engine stopped after a failed step (a bug, a tensor-parallel rank lost).
        self.engine_error: BaseException | None = None
        # Called on the event loop when loading fails or the engine stops (the launcher stops
        # the server, which exits non-zero).
        self.on_failed: Callable[[], None] | None = None
        self._load_engine = load_engine
        self._lock = threading.Lock()
        self._num_admitted = 0
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- loading --------------------------------------------------------------------------

    def start_loading(self) -> None:
        """Load the engine in a thread so the server answers /health (503) meanwhile."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._load, name="tokenmill-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            engine = self._load_engine()
        except BaseException as e:  # reported through /health and the exit status
            logger.exception("loading the model failed")
            with self._lock:
                self.load_error = e
                if self.status is ServerStatus.LOADING:
                    self.status = ServerStatus.FAILED
            self._report_failure()
            return
        engine.on_dead = self._engine_died
        with self._lock:
            if self.status is ServerStatus.LOADING:
                self.engine = engine
                self.status = ServerStatus.READY
        if self.engine is engine:
            logger.info("ready: %s", describe_memory_plan(engine))
        else:  # a shutdown came while loading; the engine thread is a daemon and stays idle
            logger.info("loaded after shutdown began; not serving")

    def _engine_died(self, error: BaseException) -> None:
        # On the engine thread: its requests have their errors already.
        logger.error("the engine stopped after an error; the server exits: %s", error)
        self.engine_error = error
        self._report_failure()

    def _report_failure(self) -> None:
        if self.on_failed is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_failed)

    @property
    def exit_status(self) -> int:
        """The server process's exit status: 1 when the model failed to load or the engine
        stopped after an error, else 0 (a drained shutdown)."""
        return 1 if self.load_error is not None or self.engine_error is not None else 0

    def stats(self) -> EngineStats | None:
        return self.engine.stats if self.engine is not None else None

    # ---- requests -------------------------------------------------------------------------

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 that says why there is none."""
        if self.status is ServerStatus.READY and self.engine is not None:
            if self.engine.is_dead:  # a genuine engine bug: the only 500 the server sends
                raise APIError(
                    500,
                    "the engine stopped after an internal error; restart the server",
                    code="engine_error",
                )
            return self.engine
        if self.status is ServerStatus.LOADING:
            raise APIError(503, "the model is still loading; retry shortly", code="loading")
        if self.status is ServerStatus.STOPPING:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        raise APIError(503, f"the model failed to load: {self.load_error}", code="load_failed")

    @property
    def admission_limit(self) -> int | None:
        """Most engine requests in flight: max_num_seqs running plus max_queue waiting."""
        if self.config.max_queue is None or self.engine is None:
            return None
        return self.engine.info.max_num_seqs + self.config.max_queue

    @property
    def num_admitted(self) -> int:
        return self._num_admitted

    def admit(self, num: int) -> Ticket:
        """Admit ``num`` engine requests or raise 429 (queue full) / 503 (not serving)."""
        self.require_engine()
        limit = self.admission_limit
        if limit is not None and self._num_admitted + num > limit:
            raise APIError(
                429,
                f"the server is at capacity ({self._num_admitted} requests in flight, limit "
                f"{limit} = max_num_seqs + max_queue); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self._num_admitted += num
        return Ticket(self, num)

    # ---- shutdown -------------------------------------------------------------------------

    def begin_drain(self, timeout: float) -> asyncio.Task[None]:
        """Stop admitting; let in-flight requests run up to ``timeout`` s, then abort them."""
        if self._drain_task is None:
            with self._lock:
                if self.status in (ServerStatus.LOADING, ServerStatus.READY):
                    self.status = ServerStatus.STOPPING
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(timeout))
        return self._drain_task

    async def _drain(self, timeout: float) -> None:
        engine = self.engine
        if engine is None:
            return
        logger.info(
            "shutting down: %d requests in flight get up to %.1fs, then are aborted",
            engine.num_unfinished,
            timeout,
        )
        await engine.shutdown(timeout)
        logger.info("engine stopped")


def describe_memory_plan(engine: AsyncEngine) -> str:
    """Weights, KV blocks and the tokens that fit, for the startup log."""
    info = engine.info
    quantization = f", {info.quantization}" if info.quantization else ""
    return (
        f"weights {_format_bytes(info.weight_nbytes)} ({info.dtype}{quantization} "
        f"on {info.device}); "
        f"KV cache {_format_bytes(info.kv_cache_nbytes)} ({info.kv_cache_dtype}) = "
        f"{info.num_kv_blocks} blocks of {info.block_size} tokens, {info.num_kv_tokens} tokens "
        "for one request; "
        f"max_model_len {info.max_model_len}, max_num_seqs {info.max_num_seqs}"
    )


def _format_bytes(num: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{num} B"
