"""The KV cache's configuration: its block size, budget, dtype and layout."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.kv_layout import KVLayout, uniform_layout

# "auto": the model dtype; "int8" / "fp8": quantized, one float32 scale per token per KV head.
KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8")

# The KV cache's share of the memory free after loading, on CPU, when kv_cache_memory is unset.
DEFAULT_KV_CACHE_FRACTION = 0.15


def parse_memory(value: str | int | float | None) -> int | float | None:
    """``"2GiB"``/``"512MB"``/bytes -> int bytes; a float in (0, 1) -> fraction of free memory;
    None (unset) stays None: the worker's default plan (worker/memory.py)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and 0 < value < 1:
            return value
        if value >= 1:
            return int(value)
        raise ValueError(f"kv_cache_memory must be bytes >= 1 or a fraction in (0, 1); got {value}")
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise ValueError(
            f"kv_cache_memory must look like '2GiB', '512MB', a byte count or a fraction; "
            f"got {value!r}"
        )
    number = float(m.group(1))
    unit = (m.group(2) or "").upper()
    if not unit and number < 1:
        return parse_memory(number)
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}
    scale |= {"T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if unit not in scale:
        raise ValueError(f"kv_cache_memory has an unknown unit {unit!r}")
    return parse_memory(int(number * scale[unit]))


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Bytes (int) or a fraction (float in (0, 1)) of the memory available at startup; None:
    # the device's default plan (EngineArgs.kv_cache_memory).
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    # Set once the worker has sized the cache from the budget (WorkerInfo.num_kv_blocks).
    num_blocks: int = 0
    kv_cache_dtype: str = "auto"
    # Which layers a block holds and each request's block tables (kv_layout.py), set from what
    # the worker loaded; None: one table, every layer in a block, no window.
    kv_layout: KVLayout | None = None

    def layout(self, num_layers: int) -> KVLayout:
        """The cache's layout (``num_layers``: the model's, for the default one)."""
        return self.kv_layout or uniform_layout(num_layers)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Per block table of a request, its layers' window (None: full attention)."""
        return self.kv_layout.group_windows if self.kv_layout else (None,)
