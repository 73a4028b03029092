"""The machine's and this process's memory, as /proc tells it, and handing freed heap back."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys


def available_memory() -> int | None:
    """Bytes the system can still give (MemAvailable), or None where /proc/meminfo is absent."""
    return _meminfo("MemAvailable")


def total_memory() -> int | None:
    """The machine's memory (MemTotal), or None where /proc/meminfo is absent."""
    return _meminfo("MemTotal")


def resident_bytes() -> int | None:
    """This process's resident memory now (VmRSS), or None where /proc is absent."""
    return process_resident_bytes("self")


def process_resident_bytes(pid: int | str) -> int | None:
    """A process's resident memory now (VmRSS; pid "self": this one's), or None when it is
    gone or /proc cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def release_freed_memory() -> None:
    """Hand freed heap back to the OS: glibc keeps it otherwise, resident for the process's life
    (a load's packing temporaries, a tokenizer build's lists and merges)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)
