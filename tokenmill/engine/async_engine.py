"""AsyncEngine: an LLMEngine stepped by a background thread, one asyncio stream per request.

All engine state is touched by the engine thread alone. Callers validate and tokenize in their
own thread (``LLMEngine.prepare_request`` is pure), then hand commands (add, abort) through a
queue; outputs come back to each request's asyncio.Queue via ``call_soon_threadsafe``. A stream
that is closed early (client gone, task cancelled) aborts its request, whose blocks are then
free after the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from tokenmill.config import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine, PreparedRequest
from tokenmill.outputs import EngineInfo, EngineStats, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; the message carries the original error."""


class RequestFailedError(EngineDeadError):
    """One request failed inside the engine; the engine and the other requests go on. (An
    EngineDeadError subclass, so callers answer both as an engine error: a 500.)"""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its limit (``max_queue``)."""


StreamItem = RequestOutput | BaseException


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool) -> None:
        self.loop = loop
        self.delta = delta  # it takes delta outputs (SamplingParams.output_kind)
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    def put(self, item: StreamItem) -> None:
        # NOTE: the caller's loop may be closed already (asyncio.run returned after cancelling
        # the stream); nobody listens then, and the engine thread must not die of it.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _before_failure(out: RequestOutput) -> RequestOutput | None:
    """What the last delta output of a request that fails carries (the tokens of the steps
    whose outputs waited unread), as an unfinished output its reader takes before the error;
    None if nothing."""
    if not any(c.token_ids or c.text for c in out.outputs):
        return None
    outputs = [replace(c, finish_reason=None, stop_reason=None) for c in out.outputs]
    return replace(out, outputs=outputs, finished=False, error=None)


def _put_all(items: list[tuple[_Stream, StreamItem]]) -> None:
    """On a stream's event loop: a step's items into their streams' queues."""
    for stream, item in items:
        stream.queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.stats = EngineStats(num_total_blocks=engine.num_total_blocks)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Requests whose stream holds an output its reader has not taken: their delta outputs
        # wait in the engine (LLMEngine.step's ``unread``), so that a reader behind (the
        # server's loop with hundreds of streams) costs no output a step that it would join
        # anyway. The engine thread adds, readers discard: single set operations, atomic under
        # the GIL; a race costs an output built, never one lost.
        self._unread: set[str] = set()
        self._num_pending = 0  # accepted but not yet finished requests
        self._lock = threading.Lock()
        self._stopping = False
        self._dead: BaseException | None = None
        self.output_hooks: list[Callable[[RequestOutput], None]] = []
        # Called once, on the engine thread, when a step fails and the engine stops (the
        # server then exits non-zero so that a supervisor restarts it).
        self.on_dead: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, args: EngineArgs, max_queue: int | None = None) -> AsyncEngine:
        return cls(LLMEngine(args), max_queue)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def num_unfinished(self) -> int:
        return self._num_pending

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> PreparedRequest:
        return self.engine.prepare_request(prompt, params)

    async def generate(
        self,
        prompt: str | list[int] | PreparedRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (each carries the deltas since the last one; delta outputs
        that queued up while the caller was busy come as one)."""
        prepared = (
            prompt
            if isinstance(prompt, PreparedRequest)
            else self.prepare(prompt, params or SamplingParams())
        )
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead}")
        if self._stopping:
            raise EngineOverloadedError("the engine is shutting down")
        with self._lock:
            if self.max_queue is not None and self._num_pending >= self.max_queue:
                raise EngineOverloadedError(
                    f"too many requests in the engine ({self._num_pending}); retry later"
                )
            self._num_pending += 1
        request_id = request_id or f"req-{time.monotonic_ns()}-{id(prepared)}"
        # A consumer behind the engine (the server's loop with hundreds of streams) takes the
        # delta outputs queued meanwhile as one: fewer, larger chunks to write, so it catches up.
        join = prepared.params.output_kind == RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), delta=join)
        self._streams[request_id] = stream
        self._submit(lambda: self._add(request_id, prepared, cache_salt, stream))
        held: StreamItem | None = None  # an error queued after joined outputs: raised next
        finished = False
        try:
            while True:
                item = held if held is not None else await stream.queue.get()
                held = None
                if join and isinstance(item, RequestOutput) and not stream.queue.empty():
                    item = item.accumulating()
                    while not item.finished and not stream.queue.empty():
                        later = stream.queue.get_nowait()
                        if isinstance(later, BaseException):
                            held = later
                            break
                        item.add(later)
                if stream.queue.empty():
                    self._unread.discard(request_id)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def reset_prefix_cache(self) -> bool:
        """Forget all cached prefix blocks; False while requests still hold blocks."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()

        def reset() -> None:
            try:
                ok = self.engine.reset_prefix_cache()
            except Exception as e:  # a core gone with its process: the caller hears of it
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(done.set_exception, e)
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done.set_result, ok)

        self._submit(reset)
        return await done

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``timeout`` s, abort the rest."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._num_pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        while self._num_pending and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.02)
        self._submit(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)

    # ---- engine thread --------------------------------------------------------------------

    def _submit(self, command: Callable[[], None] | None) -> None:
        self._commands.put(command)  # type: ignore[arg-type]
        self._wake.set()

    def _add(
        self, request_id: str, prepared: PreparedRequest, cache_salt: str | None, stream: _Stream
    ) -> None:
        try:
            self.engine.add_request(prepared, request_id=request_id, cache_salt=cache_salt)
        except ValueError as e:  # e.g. a duplicate id: the caller sees it, the loop goes on
            self._end(request_id)
            stream.put(e)

    def _abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            return
        out = self.engine.abort_request(request_id)
        stream = self._end(request_id)
        if out is not None and stream is not None:
            stream.put(out)

    def _end(self, request_id: str) -> _Stream | None:
        stream = self._streams.pop(request_id, None)
        self._unread.discard(request_id)
        if stream is not None:
            with self._lock:
                self._num_pending -= 1
        return stream

    def _loop(self) -> None:
        while True:
            # NOTE: a failed engine steps no more (it would fail again, each time, at full
            # speed: the requests it ended still wait for a step to tell the worker); it
            # answers commands until shutdown.
            if self._dead is not None or not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
            self._wake.clear()
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command is None:
                    return
                try:
                    command()
                except Exception:  # a failed add/abort must not take the step loop down
                    logger.exception("engine command failed")
            if self._dead is not None:
                continue
            if not self.engine.has_unfinished_requests():
                self._refresh_stats()
                continue
            try:
                outputs = self.engine.step(self._unread)
            except Exception as e:  # an engine bug: fail every request, keep the thread alive
                self._fail(e, "engine step failed")
                continue
            self._deliver(outputs)
            self._refresh_stats()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one hand-off to each listening event loop, not
        one an output (each writes the loop's self-pipe and wakes its thread to contend for
        the GIL while the rest go out: ~1 ms of the engine thread a step at 256 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, StreamItem]]] = {}
        for out in outputs:
            for hook in self.output_hooks:
                hook(out)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                self._end(out.request_id)
            else:
                self._unread.add(out.request_id)
            items = by_loop.setdefault(stream.loop, [])
            if out.error is None:
                items.append((stream, out))
                continue
            if stream.delta and (partial := _before_failure(out)) is not None:
                items.append((stream, partial))
            items.append((stream, RequestFailedError(out.error)))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens (_Stream.put)
                loop.call_soon_threadsafe(_put_all, items)

    def _refresh_stats(self) -> None:
        if self._dead is not None:
            return
        try:
            self.stats = self.engine.stats()
        except Exception as e:  # stats ask every tensor-parallel rank, and one may be gone
            self._fail(e, "reading the engine's stats failed")

    def _fail(self, error: Exception, what: str) -> None:
        """The engine cannot go on: every request fails with ``error``, the thread lives on
        (to answer aborts), and ``on_dead`` tells the server."""
        logger.exception(what, exc_info=error)
        self._dead = error
        for request_id in list(self._streams):
            out = self.engine.abort_request(request_id)
            stream = self._end(request_id)
            if stream is None:
                continue
            partial = _before_failure(out) if stream.delta and out is not None else None
            if partial is not None:
                stream.put(partial)
            stream.put(EngineDeadError(f"{what}: {error}"))
        if self.on_dead is not None:
            self.on_dead(error)
