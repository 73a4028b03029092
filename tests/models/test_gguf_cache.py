"""The startup caches: the packed-model cache (models/gguf_cache.py) and the helpers under it
(modelfile.py: file identity, atomic writes, remembered checksums).

A cached load must compute exactly what a fresh one does (compared on the logits of a prefill
through both, exactly), and every entry must be dropped when what it depends on changes: the
file's bytes or mtime, the format version, the load's arguments; a damaged entry is deleted
and the model loaded from the file; TOKENMILL_NO_CACHE=1 writes and reads nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf_loading import LAYER_TYPES, write_tiny_gguf

from tokenmill.config import CacheConfig
from tokenmill.kernels import cpu_library
from tokenmill.models import gguf_cache, loader
from tokenmill.models.loader import load_model, load_model_config
from tokenmill.quant import PackedQuantMethod
from tokenmill.resolve import resolve_model
from tokenmill.store import file_identity, record_sha256, verified_sha256, write_atomic
from tokenmill.worker.memory import dummy_prefill

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache directory of this test's own, which takes the tiny files."""
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENMILL_NO_CACHE", raising=False)
    monkeypatch.setattr(gguf_cache, "MIN_FILE_BYTES", 0)
    return tmp_path / "cache" / "packed"


@pytest.fixture
def gguf_path(tmp_path) -> Path:
    """A tiny file with a type the C re-lay does not take (Q4_1), which torch repacks: the
    files the cache is for."""
    types = [dict(LAYER_TYPES[0], attn_v=T.Q4_1), *LAYER_TYPES[1:]]
    return write_tiny_gguf(tmp_path / "tiny.gguf", "gemma3", layer_types=types).path


def _load(path: Path, max_position: int = 64):
    config = load_model_config(resolve_model(str(path)))
    return load_model(config, torch.float32, CPU, max_position, PackedQuantMethod(), None, "cpu")


def _logits(model) -> torch.Tensor:
    run = dummy_prefill(model, CacheConfig(16), torch.float32, CPU, 20, 64, 20)
    return run()


class _Loads:
    """Counts the loads from the file (not from the cache)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = loader._build_and_load

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(loader, "_build_and_load", counted)


def test_second_load_comes_from_the_cache_and_computes_the_same(cache, gguf_path, monkeypatch):
    loads = _Loads(monkeypatch)
    fresh = _load(gguf_path)
    assert loads.count == 1 and len(list(cache.glob("*.pt"))) == 1
    assert not list(cache.glob(".*.tmp"))  # written atomically: no temporary left
    cached = _load(gguf_path)
    assert loads.count == 1  # no repacking
    assert torch.equal(_logits(fresh), _logits(cached))
    # Kernels are bound after loading: the cached model's are the ones asked for.
    assert type(cached.kernels) is type(fresh.kernels)


def test_a_changed_file_is_loaded_afresh(cache, gguf_path, monkeypatch):
    loads = _Loads(monkeypatch)
    _load(gguf_path)
    before = file_identity(gguf_path)
    # Same size and mtime, other bytes in the tensor data (the file's last MiB here).
    stat = gguf_path.stat()
    data = bytearray(gguf_path.read_bytes())
    data[-100] ^= 0xFF
    gguf_path.write_bytes(bytes(data))
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_identity(gguf_path) != before
    _load(gguf_path)
    assert loads.count == 2
    # Only the mtime changed: a new identity too.
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _load(gguf_path)
    assert loads.count == 3


def test_format_version_and_arguments_are_in_the_key(cache, gguf_path, monkeypatch):
    loads = _Loads(monkeypatch)
    _load(gguf_path)
    _load(gguf_path, max_position=32)  # the same weights: the same entry
    assert loads.count == 1
    monkeypatch.setattr(gguf_cache, "FORMAT_VERSION", gguf_cache.FORMAT_VERSION + 1)
    gguf_cache.code_version.cache_clear()
    try:
        _load(gguf_path)
    finally:
        gguf_cache.code_version.cache_clear()
    assert loads.count == 2


def test_another_context_length_shares_the_entry_and_computes_the_same(
    cache, gguf_path, monkeypatch
):
    """An entry saved at one max_position serves another: its RoPE tables are rebuilt for the
    new length, the same as a fresh load's, and it computes exactly what a fresh load does."""
    loads = _Loads(monkeypatch)
    _load(gguf_path, max_position=32)
    cached = _load(gguf_path, max_position=96)
    assert loads.count == 1 and len(list(cache.glob("*.pt"))) == 1
    monkeypatch.setenv("TOKENMILL_NO_CACHE", "1")
    fresh = _load(gguf_path, max_position=96)
    tables = [(m.cos, m.sin) for m in cached.modules() if hasattr(m, "inv_freq")]
    fresh_tables = [(m.cos, m.sin) for m in fresh.modules() if hasattr(m, "inv_freq")]
    assert tables and all(cos.shape[0] == 96 for cos, _ in tables)
    for (cos, sin), (cos2, sin2) in zip(tables, fresh_tables, strict=True):
        assert torch.equal(cos, cos2) and torch.equal(sin, sin2)
    assert torch.equal(_logits(cached), _logits(fresh))


def test_damaged_entry_is_dropped_and_rebuilt(cache, gguf_path, monkeypatch):
    loads = _Loads(monkeypatch)
    _load(gguf_path)
    (entry,) = cache.glob("*.pt")
    entry.write_bytes(b"not a torch file")
    model = _load(gguf_path)
    assert loads.count == 2 and model is not None
    assert entry.stat().st_size > 1000  # rewritten whole


def test_no_cache_writes_and_reads_nothing(cache, gguf_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_NO_CACHE", "1")
    loads = _Loads(monkeypatch)
    _load(gguf_path)
    _load(gguf_path)
    assert loads.count == 2 and not cache.exists()


def test_small_files_are_not_cached(cache, gguf_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "MIN_FILE_BYTES", gguf_path.stat().st_size + 1)
    _load(gguf_path)
    assert not cache.exists()


def test_only_the_most_recent_entries_are_kept(cache, gguf_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "MAX_ENTRIES", 2)
    base = gguf_cache.FORMAT_VERSION
    for version in (1, 2, 3):  # three code versions: three entries written
        monkeypatch.setattr(gguf_cache, "FORMAT_VERSION", base + version)
        gguf_cache.code_version.cache_clear()
        try:
            _load(gguf_path)
        finally:
            gguf_cache.code_version.cache_clear()
    assert len(list(cache.glob("*.pt"))) == 2


def test_write_atomic_leaves_the_old_file_on_failure(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomic(target, fail)
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


def test_remembered_checksum_is_forgotten_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENMILL_NO_CACHE", raising=False)
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 100)
    assert not verified_sha256(f, "abc")
    record_sha256(f, "abc")
    assert verified_sha256(f, "abc") and not verified_sha256(f, "abd")
    f.write_bytes(b"y" * 100)
    assert not verified_sha256(f, "abc")
    monkeypatch.setenv("TOKENMILL_NO_CACHE", "1")
    record_sha256(f, "abc")
    assert not verified_sha256(f, "abc")


def _header_only_gguf(path: Path, types: list[int]) -> Path:
    """A GGUF whose tensors (one a type, ggml type ids) hold random blocks: enough for a look
    at its header."""
    import gguf
    import numpy as np

    from tokenmill.quant.gguf_blocks import BLOCK_CODES

    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i, t in enumerate(types):
        if t == 0:
            writer.add_tensor(f"t{i}", np.ones(256, dtype=np.float32))
            continue
        elems, nbytes, _ = BLOCK_CODES[t]
        data = rng.integers(0, 256, size=(4, 256 // elems * nbytes), dtype=np.uint8)
        writer.add_tensor(f"t{i}", data, raw_dtype=gguf.GGMLQuantizationType(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_only_files_that_torch_repacks_get_an_entry(tmp_path, gguf_path) -> None:
    """A file whose quantized tensors the C kernels re-lay at load (Q4_0, Q5_0, Q8_0, Q4_K,
    Q5_K, Q6_K: a Q4_K_M, Q5_K_M, Q4_0 or Q8_0 model's) gets no entry, no second copy on disk
    (where the kernels are not built, torch repacks it and it gets one). One with another
    type gets one."""
    relaid_files = [("q4km", [0, 12, 14]), ("q5km", [0, 13, 14]), ("q4_0", [0, 2, 14])]
    relaid_files += [("q5_0", [0, 6, 8]), ("q8_0", [0, 8])]
    for name, types in relaid_files:
        relaid = _header_only_gguf(tmp_path / f"{name}.gguf", types)
        assert gguf_cache.repacks_in_torch(relaid) == (not cpu_library.available())
    assert gguf_cache.repacks_in_torch(_header_only_gguf(tmp_path / "q4_1.gguf", [0, 12, 3]))
    assert gguf_cache.repacks_in_torch(gguf_path)  # the tiny model's Q4_1 tensor
