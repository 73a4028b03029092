"""``tokenmill models`` / ``tokenmill show``: model files listed and described from their
headers, names resolved through the model directory, and a model too big for memory refused
before it loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenmill.engine import LLMEngine
from tokenmill.entrypoints.models import catalog
from tokenmill.modelfile import read_gguf, summarize
from tokenmill.resolve import resolve_model


def _tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A 1-layer GGUF header with small tensors (its weights are never run here)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    w.add_chat_template("{{ messages[0]['content'] }}")
    q8 = gguf.quants.quantize(np.ones((32, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model_dir(tmp_path, tiny_model_dir, monkeypatch) -> Path:
    directory = tmp_path / "models"
    directory.mkdir()
    _tiny_gguf(directory / "tiny-q8.gguf")
    shutil.copytree(tiny_model_dir("qwen3"), directory / "tiny-qwen3")
    (directory / "junk.gguf").write_bytes(b"not a model")
    elsewhere = _tiny_gguf(tmp_path / "elsewhere.gguf", arch="rwkv6")
    (directory / "aliases.toml").write_text(
        f'[aliases]\nother = "{elsewhere}"\nmissing = "absent.gguf"\n'
    )
    monkeypatch.setenv("TOKENMILL_MODEL_DIR", str(directory))
    return directory


def test_the_header_reader_agrees_with_the_gguf_package(tmp_path) -> None:
    path = _tiny_gguf(tmp_path / "m.gguf")
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.shape == tuple(int(d) for d in reversed(ref.shape))
        assert mine.offset == ref.data_offset and mine.num_bytes == ref.n_bytes
    assert ours.metadata["llama.context_length"] == 2048


def test_catalog_lists_files_directories_and_aliases(model_dir) -> None:
    entries = {e.name: e for e in catalog(model_dir)}
    assert {"gemma-3-270m", "tiny-q8", "tiny-qwen3", "junk", "other", "missing"} <= set(entries)
    q8 = entries["tiny-q8"].summary
    assert q8.architecture == "llama" and q8.file_type == "Q8_0" and q8.context_length == 2048
    assert q8.num_parameters == 32 * 64 + 64
    qwen = entries["tiny-qwen3"].summary
    assert qwen.format == "hf" and qwen.architecture == "qwen3" and qwen.num_parameters > 0
    assert "not a GGUF file" in entries["junk"].error
    assert "no such model" in entries["missing"].error
    assert entries["other"].summary.architecture == "rwkv6"
    gemma = entries["gemma-3-270m"].summary
    # The estimate of the weights tokenmill keeps: within 3% of the 240 MiB measured (the
    # file's bytes but q/k beside a Q8_0 v, held as "q8", which the estimate cannot see).
    assert abs(gemma.weight_bytes_estimate / 2**20 - 240) < 0.03 * 240


def test_names_resolve_through_the_model_directory(model_dir) -> None:
    assert resolve_model("tiny-q8").path == model_dir / "tiny-q8.gguf"
    assert resolve_model("tiny-qwen3").format == "hf"
    assert resolve_model("other").path.name == "elsewhere.gguf"
    with pytest.raises(ValueError, match="alias 'missing'"):
        resolve_model("missing")
    with pytest.raises(ValueError, match="tokenmill models"):
        resolve_model("nothing-like-it")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_models_and_show_on_the_command_line(model_dir) -> None:
    listed = _cli("models", "--model-dir", str(model_dir))
    assert listed.returncode == 0, listed.stderr
    assert "tiny-q8" in listed.stdout and "rwkv6 (unsupported)" in listed.stdout
    assert "packed-model cache: " in listed.stdout and "entries" in listed.stdout
    shown = _cli("show", "tiny-qwen3", "--model-dir", str(model_dir), "--max-model-len", "256")
    assert shown.returncode == 0, shown.stderr
    assert "architecture  qwen3" in shown.stdout
    assert "KV cache" in shown.stdout and "at 256 tokens" in shown.stdout
    shown = _cli("show", "other", "--model-dir", str(model_dir))
    assert "not supported; supported:" in shown.stdout
    assert "{{ messages[0]['content'] }}" in shown.stdout  # the chat template
    absent = _cli("show", "/no/such/model.gguf")
    assert absent.returncode == 2 and absent.stderr.count("\n") == 1
    assert "unknown model" in absent.stderr


def test_a_model_too_big_for_memory_is_refused_before_it_loads(tiny_model_dir, monkeypatch):
    monkeypatch.setattr("tokenmill.worker.worker.available_memory", lambda: 1 << 16)
    with pytest.raises(ValueError, match=r"needs about .* this machine has 64.0 KiB"):
        LLMEngine.from_args(model=str(tiny_model_dir("llama")), max_model_len=64)
    summary = summarize(tiny_model_dir("llama"))
    assert summary.weight_bytes_estimate == summary.num_parameters * 4
