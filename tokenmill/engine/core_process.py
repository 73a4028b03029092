"""The engine core in a process of its own (EngineArgs.core_process), behind a pipe.

    this process: LLMEngine (tokenizer, outputs)       the core's process: EngineCore
      add_requests, finish_requests, reset  ------->     commands, taken in between steps
      step(): the updates that came          <-------    each step's updates (columns), stats

Why: in one process the output side (detokenizing, RequestOutputs, a server's streams) and the
core's step share one interpreter lock, and each waits for the other. At 256 streams the core's
share of an engine step is ~1.6 ms of ~2.6 (benchmarks/host_step.py): apart, the core steps
again while the front turns the last step's tokens into text (vLLM's engine-core process).

The core steps on its own while it has requests, and sends each step's updates; the front's
``step`` takes what came, waiting a little while nothing has. A stop string thus ends a
sequence a step or two late: the core may run tokens past it, which the output side drops (the
sequence has finished there). A step's updates travel as columns (ids, token lists, and the few
updates with more in them), as pickling hundreds of RequestUpdate objects would cost the core
more than the step's scheduling does.

A structured output's compiled grammar crosses as its source and is compiled again in the
core's process (structured/compiler.py: llguidance's matcher does not pickle).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from tokenmill.config import EngineArgs, EngineConfig, WorkerInfo
from tokenmill.core.sched_output import RequestUpdate
from tokenmill.engine.engine_core import EngineCore
from tokenmill.executor.base import accept_child
from tokenmill.memory import settle_heap
from tokenmill.outputs import EngineStats
from tokenmill.request import FinishReason, Request

logger = logging.getLogger(__name__)

# How long ``step`` waits for the core's next updates before it returns none, so that its
# caller takes in new requests and aborts meanwhile.
_WAIT_S = 0.005
# The core sends its stats after a step that ended a request or left it no work, else at most
# this often.
_STATS_EVERY_S = 0.05
# How long shutdown waits for the core's process to release the model before killing it.
_SHUTDOWN_S = 30.0
_ADDRESS_ENV, _AUTHKEY_ENV = "TOKENMILL_CORE_ADDRESS", "TOKENMILL_CORE_AUTHKEY"
# The child's program. NOTE: not ``-m`` this module: the package imports it first (runpy warns).
_MAIN = "import sys; from tokenmill.engine.core_process import main; sys.exit(main())"

# A step's updates on the wire: the ids, their new tokens, and (index, update) for the updates
# that carry more than tokens (a finish, log-probs, timings, an embedding).
Packed = tuple[list[str], list[list[int]], list[tuple[int, RequestUpdate]]]


def pack(updates: list[RequestUpdate]) -> Packed:
    rare = [
        (i, u)
        for i, u in enumerate(updates)
        if u.finish_reason is not None
        or u.timing is not None
        or u.logprobs is not None
        or u.prompt_logprobs is not None
        or u.embedding is not None
    ]
    return [u.req_id for u in updates], [u.new_token_ids for u in updates], rare


def unpack(packed: Packed) -> list[RequestUpdate]:
    ids, tokens, rare = packed
    updates = [RequestUpdate(req_id, new) for req_id, new in zip(ids, tokens)]
    for i, update in rare:
        updates[i] = update
    return updates


class CoreProcess:
    """EngineCore's calls, run by a core in a child process (started here: it loads the
    model; ValueError as EngineCore's where the arguments cannot run). ``setup``: "module:
    function", called by the child first (a test's or a benchmark's patches; the child has the
    parent's sys.path).

    The child is a fresh ``python`` running ``main`` (as the tensor-parallel ranks are:
    a fresh interpreter, no fork of a process holding threads, no re-import of the caller's
    script as multiprocessing's spawn does), connected over a local socket with a key of its
    own."""

    def __init__(self, args: EngineArgs, setup: str | None = None) -> None:
        authkey = secrets.token_bytes(16)
        with Listener(family="AF_UNIX", authkey=authkey) as listener:
            env = {**os.environ, _ADDRESS_ENV: listener.address, _AUTHKEY_ENV: authkey.hex()}
            self._proc = subprocess.Popen([sys.executable, "-c", _MAIN], env=env)
            conn = accept_child(listener, self._proc)
        if conn is None:
            self._proc.kill()
            raise RuntimeError(
                f"the engine core's process did not start (exit code {self._proc.wait()})"
            )
        self._conn = conn
        log_level = logging.getLogger("tokenmill").getEffectiveLevel()
        self._conn.send((args, setup, sys.path, log_level))
        try:
            started = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the engine core's process exited while starting (code {self._proc.wait()})"
            ) from None
        if started[0] == "start_failed":
            self._proc.wait()
            self._conn.close()
            _, is_value_error, message = started
            raise ValueError(message) if is_value_error else RuntimeError(message)
        # Stopped by ``shutdown``, else as this object goes or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        _, worker, config, stats = started
        self.worker: WorkerInfo = worker
        self.config: EngineConfig = config
        self._live: set[str] = set()  # sequences added and not yet seen to finish
        self._pending: list[RequestUpdate] = []  # received, not yet taken by ``step``
        self._stats: EngineStats = stats  # as the core last said: here, as it started
        self._replies: list[Any] = []
        self._dead: str | None = None  # why the core is gone
        # Commands sent, and whether the core, having taken them all, said it had no work
        # left: until then it may still hold blocks (an abort or a stop is taken between
        # steps), so there is still something to wait for (``has_unfinished_requests``).
        self._num_sent = 0
        self._settled = True

    def add_requests(self, seqs: list[Request], cache_salt: str | None = None) -> None:
        """As EngineCore.add_requests: ValueError if an id is in use (a sequence here)."""
        taken = [req.req_id for req in seqs if req.req_id in self._live]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        self._send(("add", seqs, cache_salt))
        self._live.update(req.req_id for req in seqs)

    def finish_requests(self, seq_ids: list[str], reason: FinishReason) -> None:
        """As EngineCore.finish_requests, in the core's next pause between steps (their blocks
        are free once ``has_unfinished_requests`` is false)."""
        self._live.difference_update(seq_ids)
        if self._dead is None:
            self._send(("finish", seq_ids, reason))

    def has_unfinished_requests(self) -> bool:
        """Sequences not yet seen to finish, updates not yet taken, or a core that has not
        yet said it is done with every command sent (and has no work left)."""
        return bool(self._live or self._pending) or not self._settled

    def step(self) -> list[RequestUpdate]:
        """The updates the core sent since the last call (waiting up to a few ms for some);
        RuntimeError once the core failed or its process is gone."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        if not self._pending and (self._live or not self._settled):
            self._receive(_WAIT_S)
        updates, self._pending = self._pending, []
        return updates

    def reset_prefix_cache(self) -> bool:
        self._send(("reset_prefix_cache",))
        while not self._replies:
            self._receive(1.0)
        return bool(self._replies.pop(0))

    def stats(self) -> EngineStats:
        """The load as the core last said: after a step where a request ended or none was
        left, else at most _STATS_EVERY_S ago. Takes in what came meanwhile (the updates wait
        for ``step``); once the core is gone, what it last said."""
        if self._dead is None:
            self._receive(0)
        return self._stats

    @property
    def num_free_blocks(self) -> int:
        """As the core last said (readable from any thread: it takes nothing in)."""
        return self._stats.num_free_blocks

    def shutdown(self) -> None:
        """Stop the core; its process releases the model and the KV cache as it exits."""
        self._dead = self._dead or "the engine core was shut down"
        self._finalizer()

    def _send(self, message: tuple) -> None:
        if self._dead is not None:
            raise RuntimeError(self._dead)
        try:
            self._conn.send(message)
        except OSError:
            self._gone()
        self._num_sent += 1
        self._settled = False

    def _receive(self, timeout: float) -> None:
        """Take in what the core sent, waiting up to ``timeout`` s for the first message."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        try:
            ready = self._conn.poll(timeout)
            while ready:
                self._take(self._conn.recv())
                ready = self._conn.poll()
        except (EOFError, OSError):
            self._gone()

    def _take(self, message: tuple) -> None:
        kind = message[0]
        if kind == "updates":
            _, packed, stats, num_taken, idle = message
            self._settled = idle and num_taken == self._num_sent
            updates = unpack(packed)
            for _, update in packed[2]:
                if update.finish_reason is not None:
                    self._live.discard(update.req_id)
            self._pending += updates
            if stats is not None:
                self._stats = stats
        elif kind == "reply":
            self._replies.append(message[1])
        elif kind == "failed":
            self._dead = f"the engine core failed: {message[1]}"
            raise RuntimeError(self._dead)

    def _gone(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
        self._dead = f"the engine core's process exited (code {self._proc.poll()})"
        raise RuntimeError(self._dead)


def _stop(proc: subprocess.Popen[bytes], conn: Connection) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            conn.send(("shutdown",))
        try:
            proc.wait(_SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    conn.close()


def main() -> int:
    """The core's process: its address and key from the environment, its arguments from the
    connection; then the core, stepping while it has work."""
    authkey = bytes.fromhex(os.environ.pop(_AUTHKEY_ENV))
    conn = Client(os.environ.pop(_ADDRESS_ENV), family="AF_UNIX", authkey=authkey)
    args, setup, sys.path[:], log_level = conn.recv()  # this process imports what its parent can
    # As the front logs: the core's lines are the in-process engine's, marked as the core's.
    logging.basicConfig(format="engine core %(process)d: %(message)s")
    logging.getLogger("tokenmill").setLevel(log_level)
    if setup is not None:
        module, _, name = setup.partition(":")
        getattr(importlib.import_module(module), name)()
    _run_core(conn, args)
    return 0


def _run_core(conn: Connection, args: EngineArgs) -> None:
    """Start the core, then step while it has work, taking commands in between."""
    try:
        core = EngineCore(args)
    except Exception as e:  # noqa: BLE001 - every start failure goes back to the front
        if not isinstance(e, ValueError):  # (arguments that cannot run: the front says why)
            logger.exception("the engine core failed to start")
        conn.send(("start_failed", isinstance(e, ValueError), str(e)))
        return
    settle_heap()  # what loading made lives as long as the core
    conn.send(("started", core.worker, core.config, core.stats()))
    # A thread takes the commands in as they come, so that the front never waits on a send
    # while this thread waits on one of its own (a large prompt against a step's updates).
    commands: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
    threading.Thread(target=_take_commands, args=(conn, commands), daemon=True).start()
    failed = False
    last_stats = 0.0
    num_taken = 0  # commands taken: each message says how many, so the front knows
    told_idle = True  # the front last heard the core had no work, with num_taken
    while True:
        # Commands: all that came; while there is nothing to step (or it failed), wait, once
        # the front knows the commands taken left nothing to do.
        while failed or not core.has_unfinished_requests() or not commands.empty():
            if commands.empty() and not (told_idle or failed or core.has_unfinished_requests()):
                conn.send(("updates", pack([]), core.stats(), num_taken, True))
                told_idle = True
            message = commands.get()
            if message is None or message[0] == "shutdown":  # the front is gone, or asks
                core.shutdown()
                return
            num_taken += 1
            told_idle = False
            try:
                _command(core, conn, message)
            except Exception:  # a bad command fails alone; the front checked it already
                logger.exception("engine core command %s failed", message[0])
        if failed:
            continue
        try:
            packed = pack(core.step())
            idle = not core.has_unfinished_requests()
            now = time.monotonic()
            stats = None
            if (
                idle
                or now - last_stats >= _STATS_EVERY_S
                or any(u.finish_reason is not None for _, u in packed[2])
            ):
                stats, last_stats = core.stats(), now
        except Exception as e:  # the front fails every request; commands are still answered
            logger.exception("engine core step failed")
            conn.send(("failed", f"{type(e).__name__}: {e}"))
            failed = True
            continue
        if packed[0] or stats is not None:
            conn.send(("updates", packed, stats, num_taken, idle))
            told_idle = idle


def _take_commands(conn: Connection, commands: queue.SimpleQueue[tuple | None]) -> None:
    try:
        while True:
            commands.put(conn.recv())
    except (EOFError, OSError):
        commands.put(None)


def _command(core: EngineCore, conn: Connection, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
        core.add_requests(message[1], message[2])
    elif kind == "finish":
        core.finish_requests(message[1], message[2])
    elif kind == "reset_prefix_cache":
        conn.send(("reply", core.reset_prefix_cache()))
    else:
        raise ValueError(f"unknown command {kind!r}")
