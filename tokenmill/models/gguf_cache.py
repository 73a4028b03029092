"""The packed-model cache: a GGUF model as loading leaves it, saved once and mapped back later.

Repacking a GGUF's blocks into tokenmill's layout (quant/packed.py) takes most of a load (~10 s
for gemma-3-270m on 2 cores); what it builds depends only on the file, the load's arguments and
tokenmill's code. So the first load saves the model (``torch.save`` of the module, after
loading and before kernels are bound) as ``<cache>/packed/<key>.pt``, and later loads map it
back with ``torch.load(mmap=True)``: no copy and no repacking, the weights' pages file-backed
(they fault in on first use, and processes that map the same entry share them).

The key hashes everything the result depends on:

- ``FORMAT_VERSION`` (bump it to drop every entry), torch's version, and a digest of
  tokenmill's own sources (every ``.py`` under the package and ``csrc``): any change to the
  code that builds, pickles or reads the layout invalidates every entry;
- the GGUF file's identity (``modelfile.file_identity``: size, mtime, its first and last MiB);
- the load's arguments: the model config, dtype, the quant method's settings and the kernel
  backend's name. Not the context length (max_position): it changes no weight, only the RoPE
  tables, which the loader rebuilds for each load (so two lengths share one entry).

An entry is written to a temporary file and renamed into place (a reader never sees half of
one); one that fails to load is deleted and the model is loaded from the GGUF. Only the
``MAX_ENTRIES`` most recently used entries are kept. ``TOKENMILL_NO_CACHE=1`` turns it off.
Only plain loads are cached: a GGUF of at least ``MIN_FILE_BYTES`` kept packed, on CPU,
without tensor parallelism or calibration, and only where torch repacks some of its tensors
(``repacks_in_torch``: the types the C kernels re-lay at load need no entry).

NOTE: an entry is a pickle (``weights_only=False``), trusted as the code itself is: it lives in
the user's own cache directory and is only ever written by this module.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import time
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.memory import human_bytes
from tokenmill.modelfile import read_gguf
from tokenmill.models.base import CausalLM
from tokenmill.quant.base import QuantMethod
from tokenmill.store import PACKED_CACHE_ENTRIES, cache_dir, evict_lru, file_identity, write_atomic

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_ENTRIES = PACKED_CACHE_ENTRIES
# Smaller files repack in well under a second: caching them buys nothing (and keeps the test
# suite's tiny models out of the cache).
MIN_FILE_BYTES = 16 << 20
_KIND = "packed"


@functools.cache
def code_version() -> str:
    """A digest of tokenmill's sources (package .py files and csrc), torch's version and
    FORMAT_VERSION: what the cached layout was built and is read by."""
    root = Path(__file__).resolve().parent.parent  # the tokenmill package
    digest = hashlib.blake2b(f"{FORMAT_VERSION}:{torch.__version__}".encode(), digest_size=16)
    files = sorted(root.rglob("*.py")) + sorted(
        p for p in (root / "csrc").rglob("*") if p.is_file()
    )
    for file in files:
        digest.update(str(file.relative_to(root)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def model_key(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    quant_method: QuantMethod | None,
    importance: dict[str, torch.Tensor] | None,
    kernels: str,
) -> str | None:
    """The cache key of this load, or None when it is not one the cache takes (or the cache is
    off)."""
    from tokenmill.quant.gguf import PackedQuantMethod

    source = config.source
    cacheable = (
        source is not None
        and source.format == "gguf"
        and device.type == "cpu"
        and config.tp.size == 1
        and not importance
        and isinstance(quant_method, PackedQuantMethod)
        and quant_method.name == "gguf"
        and source.path.stat().st_size >= MIN_FILE_BYTES
        and repacks_in_torch(source.path)
    )
    if not cacheable or cache_dir(_KIND) is None:
        return None
    assert source is not None and quant_method is not None
    method = f"{type(quant_method).__qualname__}{sorted(vars(quant_method).items())!r}"
    parts = [
        code_version(),
        file_identity(source.path),
        repr(config),
        str(dtype),
        method,
        kernels,
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def repacks_in_torch(path: Path) -> bool:
    """Whether some of the file's quantized tensors are repacked by the torch code, which an
    entry saves, rather than re-laid by the C kernels in one pass over their bytes
    (cpu_library.relays: Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) or kept as stored (floats). A Q4_K_M,
    Q5_K_M, Q4_0 or Q8_0 file needs no entry: its first load re-lays it about as fast as an
    entry maps (Llama 1B shape Q4_K_M, AMD EPYC Zen 4: 1.8 s whole), and an entry is a second
    copy of it on disk."""
    from tokenmill.kernels import cpu_library
    from tokenmill.quant.gguf_blocks import BLOCK_CODES

    def repacked(t) -> bool:  # a stack of experts [E, N, K] packs as its E·N rows
        rows = math.prod(t.shape[:-1])
        return t.ggml_type in BLOCK_CODES and not cpu_library.relays(
            t.ggml_type, (rows, t.shape[-1])
        )

    return any(repacked(t) for t in read_gguf(path).tensors)


def _entry(key: str) -> Path | None:
    directory = cache_dir(_KIND)
    return None if directory is None else directory / f"{key}.pt"


def load(key: str) -> CausalLM | None:
    """The cached model of ``key``, its weights mapped from the entry, or None (no entry, or
    one that does not load: it is deleted)."""
    path = _entry(key)
    if path is None or not path.is_file():
        return None
    started = time.perf_counter()
    try:
        model = torch.load(path, mmap=True, weights_only=False)
        if not isinstance(model, CausalLM):
            raise TypeError(f"holds a {type(model).__name__}, not a model")
    except Exception as e:  # a damaged or foreign entry: load from the file instead
        logger.warning("dropping packed-model cache entry %s: %s", path, e)
        path.unlink(missing_ok=True)
        return None
    os.utime(path)  # most recently used: the last one evicted
    _populate(path)
    logger.info(
        "packed weights from the cache (%s) in %.2fs", path.name, time.perf_counter() - started
    )
    return model


_MADV_WILLNEED = 3
_MADV_POPULATE_READ = 22  # Linux 5.14+


def _populate(path: Path) -> None:
    """Fault the entry's mapped pages in now (MADV_POPULATE_READ; MADV_WILLNEED, a read-ahead,
    where the kernel lacks it): loaded means ready to compute at full speed, as a load from the
    GGUF leaves it, not ~70k page faults spread over the first steps. The pages are the page
    cache's: processes that map the same entry share them."""
    import ctypes

    target = str(path.resolve())
    try:
        with open("/proc/self/maps") as f:
            ranges = [line.split()[0] for line in f if line.rstrip().endswith(target)]
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for extent in ranges:
        start, end = (int(x, 16) for x in extent.split("-"))
        if libc.madvise(start, end - start, _MADV_POPULATE_READ) != 0:
            libc.madvise(start, end - start, _MADV_WILLNEED)


def save(key: str, model: CausalLM) -> None:
    """Store ``model`` (loaded, kernels not bound) as ``key``'s entry; a failure (a full or
    read-only disk) only costs the repacking next time."""
    path = _entry(key)
    if path is None:
        return
    started = time.perf_counter()
    try:
        write_atomic(path, lambda tmp: torch.save(model, tmp))
    except Exception as e:
        logger.warning("packed-model cache not written (%s): %s", path, e)
        return
    logger.info(
        "packed weights cached as %s (%s) in %.2fs",
        path,
        human_bytes(path.stat().st_size),
        time.perf_counter() - started,
    )
    evict_lru(path.parent, "*.pt", MAX_ENTRIES)
