"""The child servers a light process runs (the router's local replicas, the host's runners):
tied to their parent's life, and stopped by SIGTERM, then SIGKILL when they overstay."""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys

logger = logging.getLogger(__name__)


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def wait_or_kill(process: subprocess.Popen, timeout: float, what: str) -> None:
    """Wait ``timeout`` seconds for ``process`` to end (it was sent SIGTERM), then kill it."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.error("%s pid %d did not stop in time: killing it", what, process.pid)
        process.kill()
        process.wait()


def stop_process(process: subprocess.Popen, timeout: float, what: str) -> None:
    """SIGTERM (a server drains its requests), then SIGKILL after ``timeout``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    wait_or_kill(process, timeout, what)
