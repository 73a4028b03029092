"""What tokenmill keeps on disk: the model directory and its aliases, and the startup caches
(their root, atomic writes, eviction of the least recently used, file identities and
remembered checksums). Every cache is optional: ``TOKENMILL_NO_CACHE`` turns them off."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib


def cache_root() -> Path:
    """Where tokenmill keeps what it writes: $TOKENMILL_CACHE, else ~/.cache/tokenmill."""
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def model_dir() -> Path:
    """Where models live: $TOKENMILL_MODEL_DIR, else $TOKENMILL_CACHE/models, else
    ~/.cache/tokenmill/models."""
    if os.environ.get("TOKENMILL_MODEL_DIR"):
        return Path(os.environ["TOKENMILL_MODEL_DIR"]).expanduser()
    return cache_root() / "models"


ALIAS_FILE = "aliases.toml"


def aliases(directory: Path | None = None) -> dict[str, Path]:
    """Names for model paths, from ``aliases.toml`` in the model directory:

        [aliases]
        qwen = "/data/qwen2.5-0.5b-instruct-q4_k_m.gguf"

    Relative paths are relative to the directory. ValueError for a malformed file."""
    directory = directory or model_dir()
    file = directory / ALIAS_FILE
    table = read_alias_file(directory).get("aliases", {})
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ValueError(f'{file}: [aliases] must map names to paths (name = "path")')
    return {name: (directory / Path(p).expanduser()) for name, p in table.items()}


def read_alias_file(directory: Path | None = None) -> dict[str, Any]:
    """The whole of the model directory's aliases.toml (its [aliases], and the [models] that
    Modelfiles created: recipes.py); {} when there is none. ValueError for a malformed file."""
    file = (directory or model_dir()) / ALIAS_FILE
    if not file.exists():
        return {}
    try:
        return tomllib.loads(file.read_text())
    except (tomllib.TOMLDecodeError, OSError) as e:
        raise ValueError(f"{file}: {e}") from None


def model_files(directory: Path | None = None) -> list[Path]:
    """The GGUF files and Hugging Face directories (with a config.json) in the model
    directory, and one level below it."""
    directory = directory or model_dir()
    if not directory.is_dir():
        return []
    found = []
    for entry in sorted(directory.iterdir()):
        is_gguf = entry.is_file() and entry.suffix == ".gguf"
        if is_gguf or (entry.is_dir() and (entry / "config.json").exists()):
            found.append(entry)
        elif entry.is_dir():
            found += sorted(p for p in entry.glob("*.gguf") if p.is_file())
    return found


# Bytes hashed from each end of a file for its identity (file_identity).
_IDENTITY_EDGE_BYTES = 1 << 20


# Entries the packed-model cache (models/gguf_cache.py) keeps, the most recently used.
PACKED_CACHE_ENTRIES = 4


def cache_dir(kind: str) -> Path | None:
    """The directory of one kind of startup cache (``$TOKENMILL_CACHE/<kind>``, by default
    ~/.cache/tokenmill/<kind>), or None when ``TOKENMILL_NO_CACHE`` is set (to anything but
    "" or "0"): every cache is optional, and a run without them computes everything afresh."""
    if os.environ.get("TOKENMILL_NO_CACHE", "") not in ("", "0"):
        return None
    return cache_root() / kind


def file_identity(path: str | Path) -> str:
    """A short hex digest that changes when the file does: its size and modification time, and
    a hash of its first and last MiB (a rewrite that keeps size and mtime, as a copy with
    ``cp -p`` of another file could, still changes its edges in practice). Not a content hash:
    cheap enough for every start (~1 ms)."""
    path = Path(path)
    st = path.stat()
    digest = hashlib.blake2b(f"{st.st_size}:{st.st_mtime_ns}".encode(), digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(_IDENTITY_EDGE_BYTES))
        if st.st_size > 2 * _IDENTITY_EDGE_BYTES:
            f.seek(st.st_size - _IDENTITY_EDGE_BYTES)
            digest.update(f.read(_IDENTITY_EDGE_BYTES))
    return digest.hexdigest()


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through ``write(temporary)`` and rename it into place, so a reader (another
    process starting at the same time) sees the old file, no file, or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def evict_lru(directory: Path, pattern: str, keep: int) -> None:
    """Delete all but the ``keep`` most recently used (modified, or touched on a hit) files of
    ``directory`` that match ``pattern``."""
    entries = []
    for p in directory.glob(pattern):
        with contextlib.suppress(FileNotFoundError):  # another process evicted it meanwhile
            entries.append((p.stat().st_mtime_ns, p))
    entries.sort(reverse=True)
    for _, p in entries[keep:]:
        p.unlink(missing_ok=True)


def verified_sha256(path: Path, expected: str) -> bool:
    """Whether ``path`` was verified (by ``record_sha256``) to hash to ``expected`` since it
    last changed: the check of a whole 250 MB file (~0.2 s) is then skipped."""
    directory = cache_dir("checksums")
    if directory is None or not path.is_file():
        return False
    try:
        stamp = json.loads((directory / f"{expected}.json").read_text())
    except (OSError, ValueError):
        return False
    return stamp == {"path": str(path.resolve()), "identity": file_identity(path)}


def record_sha256(path: Path, expected: str) -> None:
    """Note that ``path``, as it is now, hashes to ``expected`` (the caller has checked)."""
    directory = cache_dir("checksums")
    if directory is None:
        return
    stamp = json.dumps({"path": str(path.resolve()), "identity": file_identity(path)})
    with contextlib.suppress(OSError):  # a cache: a read-only home costs the check next time
        write_atomic(directory / f"{expected}.json", lambda tmp: tmp.write_text(stamp))
