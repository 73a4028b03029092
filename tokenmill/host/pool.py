"""The runners: one ``tokenmill serve MODEL`` subprocess a loaded model.

``acquire(name)`` leases a model's runner, starting it first when it is not loaded (a second
request for a model that is loading waits for the same load); ``release`` ends the lease and
sets when the idle runner expires (its keep_alive). A runner with a lease is never stopped.
Before a runner starts, room is made: while the loaded models number ``max_loaded_models``,
or their resident memory plus the new model's estimate exceeds the budget, the least recently
used idle runner stops; when only leased ones are left, the request gets a 503 that names the
numbers. ``reap`` stops the runners whose keep_alive ran out.

The event loop is the only thread that touches the pool, so a check and the change it guards
cannot interleave (the subprocess calls that block run in threads, and the pool's state is
changed around them, not during).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from tokenmill.catalog import Entry
from tokenmill.embedded import EMBEDDED_MODELS
from tokenmill.host.config import HostConfig
from tokenmill.memory import human_bytes, process_resident_bytes
from tokenmill.router.processes import die_with_parent, stop_process
from tokenmill.router.proxy import Proxy
from tokenmill.router.replicas import ReplicaSet

logger = logging.getLogger(__name__)

# What a runner's process takes beside its weights and KV cache (Python, torch, buffers): the
# estimate of a model not yet loaded; a loaded one counts its measured resident memory.
PROCESS_OVERHEAD = 400 * 2**20
HEALTH_POLL_S = 0.2


class HostError(Exception):
    """A request the host cannot serve: ``status`` and a message (the route's error shape)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclasses.dataclass(eq=False)
class Runner:
    """One loaded (or loading) model's subprocess."""

    name: str
    estimate: int  # bytes, before it is up
    port: int
    process: subprocess.Popen
    proxy: Proxy
    loaded_at: float = 0.0  # wall clock, when it came up
    leases: int = 0
    last_used: float = 0.0  # monotonic
    expires: float | None = None  # monotonic; None: never (keep_alive negative)
    retired: bool = False  # recreated or deleted: it stops when its last lease ends
    context_length: int = 0  # the context it serves (its /v1/models), for /api/ps

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def resident(self) -> int:
        """Its process's resident memory now (the estimate while it cannot be read)."""
        return process_resident_bytes(self.process.pid) or self.estimate


class RunnerPool:
    def __init__(
        self,
        config: HostConfig,
        client: httpx.AsyncClient,
        models: Callable[[], list[Entry]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.client = client
        self.models = models
        self.clock = clock
        self.runners: dict[str, Runner] = {}  # up, by model name
        self._loading: dict[str, asyncio.Task[Runner]] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    # ---- names ----------------------------------------------------------------------------

    def find(self, name: str | None) -> Entry:
        """The catalog entry a request's ``model`` names ("name", "name:latest"; none: the
        default model); 404 naming the models there are."""
        wanted = canonical(name or self.config.default_model)
        entries = [e for e in self.models() if servable(e)]
        for entry in entries:
            if entry.name == wanted:
                return entry
        names = ", ".join(e.name for e in entries) or "none"
        raise HostError(404, f"model '{name or wanted}' not found; the models here: {names}",
                        "model_not_found")  # fmt: skip

    # ---- leases ---------------------------------------------------------------------------

    async def acquire(self, name: str | None) -> Runner:
        """A lease on the runner of the model ``name`` names, started if need be."""
        entry = self.find(name)
        # Looked up again after each wait: a runner that came up idle may have been stopped
        # (to make room for another) before this request resumed.
        while (runner := self.runners.get(entry.name)) is None:
            task = self._loading.get(entry.name)
            if task is None:
                task = asyncio.ensure_future(self._load(entry))
                self._loading[entry.name] = task
                task.add_done_callback(lambda _, n=entry.name: self._loading.pop(n, None))
            await asyncio.shield(task)
        runner.leases += 1
        runner.last_used = self.clock()
        return runner

    def acquire_loaded(self, name: str) -> Runner:
        """A lease on a loaded model's runner, never loading it (the dashboard watches one);
        404 naming the loaded ones."""
        entry = self.find(name)
        runner = self.runners.get(entry.name)
        if runner is None:
            loaded = ", ".join(sorted(self.runners)) or "none"
            raise HostError(404, f"model '{name}' is not loaded; loaded now: {loaded}",
                            "model_not_loaded")  # fmt: skip
        runner.leases += 1
        return runner

    def release(self, runner: Runner, keep_alive: float | None) -> None:
        """End a lease; the runner expires ``keep_alive`` seconds after it (None: never; 0:
        it stops once no lease is left)."""
        runner.leases -= 1
        runner.last_used = self.clock()
        runner.expires = None if keep_alive is None else runner.last_used + keep_alive
        if runner.leases == 0 and (keep_alive == 0 or runner.retired):
            self._stop_later(runner, "retired" if runner.retired else "keep_alive 0")

    def release_watcher(self, runner: Runner) -> None:
        """End a lease that only looked (a page, a figure): the model's keep_alive runs on
        as its last request set it."""
        runner.leases -= 1
        if runner.leases == 0 and runner.retired:
            self._stop_later(runner, "retired")

    # ---- loading --------------------------------------------------------------------------

    async def load(self, name: str | None, keep_alive: float | None) -> Runner:
        """Load a model (Ollama's empty request) and leave it idle for its keep_alive."""
        runner = await self.acquire(name)
        self.release(runner, keep_alive)
        return runner

    async def _load(self, entry: Entry) -> Runner:
        estimate = self._estimate(entry)
        await self._make_room(entry.name, estimate)
        port = _free_port()
        argv = runner_argv(self.config, entry, port)
        started = time.monotonic()
        logger.info("loading %s (%s, estimated %s) on port %d", entry.name,
                    entry.path or "embedded", human_bytes(estimate), port)  # fmt: skip
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        threading.Thread(target=_relay, args=(process, entry.name), daemon=True).start()
        replicas = ReplicaSet.from_urls([f"http://127.0.0.1:{port}"])
        proxy = Proxy(self.client, replicas, self.config.max_body_bytes)
        runner = Runner(entry.name, estimate, port, process, proxy)
        try:
            await self._wait_up(runner)
        except BaseException:
            await asyncio.to_thread(stop_process, process, self.config.stop_timeout, "runner")
            raise
        replicas.mark_up(0)
        runner.context_length = await self._context_length(runner)
        runner.loaded_at = time.time()
        runner.last_used = self.clock()
        self.runners[entry.name] = runner
        logger.info("loaded %s in %.1fs (pid %d, resident %s)", entry.name,
                    time.monotonic() - started, process.pid, human_bytes(runner.resident))  # fmt: skip
        return runner

    async def _wait_up(self, runner: Runner) -> None:
        deadline = time.monotonic() + self.config.load_timeout
        while True:
            status = runner.process.poll()
            if status is not None:
                raise HostError(503, f"model '{runner.name}' failed to load: its runner exited "
                                f"with status {status} (the server's log says why)",
                                "load_failed")  # fmt: skip
            # Not listening yet, or not answering JSON: polled again below.
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await self.client.get(f"{runner.url}/health", timeout=2.0)
                if r.status_code == 200:
                    return
                if r.status_code == 503 and r.json().get("status") == "failed":
                    raise HostError(503, f"model '{runner.name}' failed to load: "
                                    f"{r.json().get('error', '')}", "load_failed")  # fmt: skip
            if time.monotonic() > deadline:
                raise HostError(503, f"model '{runner.name}' did not load within "
                                f"{self.config.load_timeout:g} s", "load_timeout")  # fmt: skip
            await asyncio.sleep(HEALTH_POLL_S)

    async def _context_length(self, runner: Runner) -> int:
        """The context the runner serves (its --max-model-len, or the model's), for /api/ps."""
        keys = self.config.api_keys
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        try:
            r = await self.client.get(f"{runner.url}/v1/models", headers=headers, timeout=5.0)
            return int(r.json()["data"][0]["max_model_len"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return 0

    def _estimate(self, entry: Entry) -> int:
        weights = entry.summary.weight_bytes_estimate if entry.summary is not None else 0
        return weights + self.config.kv_cache_memory + PROCESS_OVERHEAD

    async def _make_room(self, name: str, estimate: int) -> None:
        """Stop idle runners, least recently used first, until ``name`` fits; 503 if it
        cannot."""
        budget = self.config.memory_budget
        if estimate > budget:
            raise HostError(503, f"model '{name}' needs about {human_bytes(estimate)}, more than "
                            f"the memory budget of {human_bytes(budget)} (--memory-budget)",
                            "model_too_large")  # fmt: skip
        while True:
            loaded = list(self.runners.values())
            count = len(loaded) + len(self._loading) - 1  # the others loading count too
            used = sum(r.resident for r in loaded)
            if count < self.config.max_loaded_models and used + estimate <= budget:
                return
            idle = [r for r in loaded if r.leases == 0]
            if not idle:
                raise HostError(
                    503,
                    f"cannot load model '{name}' (about {human_bytes(estimate)}): "
                    f"{len(loaded)} models are loaded (at most {self.config.max_loaded_models}),"
                    f" taking {human_bytes(used)} of the {human_bytes(budget)} budget, and every "
                    "one has requests in flight; retry when one is idle",
                    "no_room",
                )
            victim = min(idle, key=lambda r: r.last_used)
            await self.stop(victim, f"making room for {name}")

    # ---- stopping -------------------------------------------------------------------------

    async def stop(self, runner: Runner, why: str) -> None:
        if self.runners.get(runner.name) is runner:
            del self.runners[runner.name]
        logger.info("unloading %s (%s)", runner.name, why)
        await asyncio.to_thread(stop_process, runner.process, self.config.stop_timeout, "runner")

    def _stop_later(self, runner: Runner, why: str) -> None:
        if self.runners.get(runner.name) is runner:
            del self.runners[runner.name]  # no new lease reaches it
        task = asyncio.ensure_future(self.stop(runner, why))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def unload(self, name: str | None) -> Entry:
        """Unload a model now if it is idle (Ollama's keep_alive 0 with no prompt); a leased
        one stops when its last lease ends."""
        entry = self.find(name)
        runner = self.runners.get(entry.name)
        if runner is not None:
            runner.expires = self.clock()
            if runner.leases == 0:
                await self.stop(runner, "keep_alive 0")
        return entry

    async def unload_if_loaded(self, name: str) -> None:
        """Stop a model's runner now (idle) or when its last lease ends: it was recreated or
        deleted."""
        runner = self.runners.get(name)
        if runner is None:
            return
        if runner.leases == 0:
            await self.stop(runner, "recreated or deleted")
        else:  # no new lease reaches it; the last one to end stops it
            del self.runners[name]
            runner.retired = True

    async def reap(self) -> None:
        """Stop the idle runners whose keep_alive ran out, and forget the ones that exited."""
        now = self.clock()
        for runner in list(self.runners.values()):
            if runner.process.poll() is not None:
                del self.runners[runner.name]
                logger.error("model %s's runner exited with status %d", runner.name,
                             runner.process.returncode)  # fmt: skip
            elif runner.leases == 0 and runner.expires is not None and runner.expires <= now:
                await self.stop(runner, "idle past its keep_alive")

    async def reap_loop(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.reap()

    async def shutdown(self) -> None:
        """Stop every runner (each drains its requests as a lone server does)."""
        for task in list(self._loading.values()):
            task.cancel()
        runners = list(self.runners.values())
        self.runners.clear()
        for runner in runners:
            if runner.process.poll() is None:
                runner.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(asyncio.to_thread(stop_process, r.process, self.config.stop_timeout,
                                                 "runner") for r in runners))  # fmt: skip
        await asyncio.gather(*self._stopping, return_exceptions=True)


def servable(entry: Entry) -> bool:
    """A model a runner can start: one found on disk, or an embedded one (fetched on load)."""
    return entry.path is not None or entry.name in EMBEDDED_MODELS


def canonical(name: str) -> str:
    """A model's name without Ollama's default tag (``smollm2:latest`` is ``smollm2``)."""
    return name.removesuffix(":latest")


def runner_argv(config: HostConfig, entry: Entry, port: int) -> list[str]:
    """A runner's command: its model, the host's serve arguments, its address and name."""
    # A created model by its name (the runner applies its Modelfile), others by their path.
    model = str(entry.path) if entry.path is not None and not entry.created else entry.name
    return [
        sys.executable, "-m", "tokenmill.cli", "serve", model, *config.runner_args,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", entry.name,
        "--kv-cache-memory", str(config.kv_cache_memory),
    ]  # fmt: skip


def _relay(process: subprocess.Popen, name: str) -> None:
    """A runner's log lines on the host's stdout, each prefixed with its model's name."""
    assert process.stdout is not None
    for line in iter(process.stdout.readline, b""):
        sys.stdout.write(f"[{name}] {line.decode(errors='replace')}")
        sys.stdout.flush()
    process.stdout.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
