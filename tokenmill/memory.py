"""The machine's and this process's memory, as /proc tells it, handing freed heap back, and
the garbage collector's settings for a process that serves."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys

# Young objects (net of those freed) that start a collection in a serving process: above what
# one engine step holds alive at once, ~12 a running request (its update, output, metrics and
# their lists): ~3,000 at 256 requests, ~12,000 at 1,024. CPython's 700 ran two or three
# collections a step at 256, which found no garbage (the step's objects die by reference
# count) and moved the outputs in flight on to older generations, whose collections then
# walked every request's token lists.
YOUNG_COLLECTION_THRESHOLD = 20_000


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


def settle_heap() -> None:
    """Garbage collection for a process that has loaded and now serves (the server's, the
    engine core's, a tensor-parallel rank's): what loading made goes out of the collector's
    sight (gc.freeze: a full collection need not walk the block pool of an H200's 2.7M KV
    blocks, 0.3 s each), and a young collection waits for YOUNG_COLLECTION_THRESHOLD objects
    instead of 700. Garbage in cycles (rare on the step path) is still collected, later."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)
