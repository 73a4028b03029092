"""The CLI as a user meets it: bad input is one line on stderr and exit status 2."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tokenmill import LLM
from tokenmill.cli import main


def _unsupported_gguf(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_unknown_model_is_one_line_exit_2(capsys, tmp_path) -> None:
    code, err = _run(capsys, ["generate", str(tmp_path / "nope.gguf"), "--prompt", "hi"])
    assert code == 2
    assert err.count("\n") == 0 and "unknown model" in err


def test_not_a_gguf_file(capsys, tmp_path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf at all")
    code, err = _run(capsys, ["generate", str(bogus), "--prompt", "hi"])
    assert code == 2 and "not a GGUF file" in err


def test_unsupported_architecture(capsys, tmp_path) -> None:
    path = _unsupported_gguf(tmp_path / "falcon.gguf")
    code, err = _run(capsys, ["generate", str(path), "--prompt", "hi"])
    assert code == 2 and "'falcon'" in err and "supported" in err
    with pytest.raises(ValueError, match="falcon"):
        LLM(str(path))


def test_bad_sampling_field(capsys, tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    code, err = _run(
        capsys,
        ["generate", model, "--prompt", "hi", "--temperature", "-1", "--max-model-len", "64"],
    )
    assert code == 2 and "temperature" in err


def test_generate_streams_text_and_reports_speed(capsys, tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    argv = ["generate", model, "--prompt", "hello", "--max-tokens", "5", "--max-model-len", "64",
            "--kv-cache-memory", "4MiB", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "5 generated" in captured.err and "tokens/s" in captured.err and "TTFT" in captured.err


def test_memory_flags_reach_the_engine_args() -> None:
    from tokenmill.cli import build_parser, engine_args_from

    parser = build_parser()
    ns = parser.parse_args(["serve", "m", "--gpu-memory-utilization", "0.5"])
    args = engine_args_from(ns)
    assert args.gpu_memory_utilization == 0.5 and args.kv_cache_memory is None
    ns = parser.parse_args(["generate", "m", "--prompt", "x", "--kv-cache-memory", "2GiB"])
    assert engine_args_from(ns).kv_cache_memory == "2GiB"
    assert engine_args_from(parser.parse_args(["serve", "m"])).gpu_memory_utilization == 0.9


def test_create_names_a_model_from_a_modelfile(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from tokenmill import recipes

    monkeypatch.setenv("TOKENMILL_MODEL_DIR", str(tmp_path / "models"))
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "weights")
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM ./weights\nSYSTEM You are Mario.\nPARAMETER top_k 5\n")
    assert main(["create", "mario", "-f", str(modelfile)]) == 0
    assert "created mario" in capsys.readouterr().out
    made = recipes.recipes()["mario"]
    assert made.base == str(tmp_path / "weights") and made.parameters == {"top_k": 5}
    modelfile.write_text("FROM nothing-here\n")
    assert main(["create", "luigi", "-f", str(modelfile)]) == 2
    assert "unknown model 'nothing-here'" in capsys.readouterr().err
    assert main(["create", "luigi", "-f", str(tmp_path / "missing")]) == 2
    assert "cannot read the Modelfile" in capsys.readouterr().err


def test_chat_runs_a_created_model_with_its_modelfile(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    import io

    monkeypatch.setenv("TOKENMILL_MODEL_DIR", str(tmp_path / "models"))
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {tiny_model_dir('llama')}\nPARAMETER temperature 0.1\n"
                         "PARAMETER num_predict 7\nSYSTEM You are Mario.\n")  # fmt: skip
    assert main(["create", "mario", "-f", str(modelfile)]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("/params\n"))
    args = [
        "chat",
        "mario",
        "--kv-cache-memory",
        "8MiB",
        "--max-model-len",
        "128",
        "--top-p",
        "0.5",
    ]
    assert main(args) == 0
    shown = capsys.readouterr()
    params = shown.out + shown.err
    # Its PARAMETERs where the command line sets none; the command line's where it does.
    assert "temperature=0.1" in params and "max_tokens=7" in params and "top_p=0.5" in params


def test_generate_runs_a_created_model_with_its_modelfile(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    monkeypatch.setenv("TOKENMILL_MODEL_DIR", str(tmp_path / "models"))
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {tiny_model_dir('llama')}\nPARAMETER num_predict 3\n"
                         "SYSTEM You are Mario.\n")  # fmt: skip
    assert main(["create", "mario", "-f", str(modelfile)]) == 0
    capsys.readouterr()
    small = ["--kv-cache-memory", "8MiB", "--max-model-len", "128", "--ignore-eos"]
    assert main(["generate", "mario", "--prompt", "hi", "--chat", *small]) == 0
    mario = capsys.readouterr()
    assert "3 generated" in mario.err  # its PARAMETER
    # Its SYSTEM message: the same prompt as its base given it by hand.
    base = [str(tiny_model_dir("llama")), "--prompt", "hi", "--chat", "--max-tokens", "3"]
    assert main(["generate", *base, "--system", "You are Mario.", *small]) == 0
    by_hand = capsys.readouterr()
    assert by_hand.out == mario.out and _prompt_tokens(by_hand.err) == _prompt_tokens(mario.err)
    assert main(["generate", "mario", "--prompt", "hi", "--max-tokens", "5", *small]) == 0
    assert "5 generated" in capsys.readouterr().err  # the command line's, where it sets one


def _prompt_tokens(report: str) -> int:
    return int(report.split("[", 1)[1].split(" prompt tokens")[0])
