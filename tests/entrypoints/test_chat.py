"""``tokenmill chat``: through a pipe and through a pseudo-terminal (pexpect), and the session's
history handling in process (tiny random Llama)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pexpect
import pytest
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.entrypoints.chat import ChatSession

FLAGS = ["--max-model-len", "512", "--kv-cache-memory", "16MiB", "--temperature", "0"]


def _cli(model) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "chat", str(model), *FLAGS]


def _cached(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"(\d+) of them cached", text)]


def test_a_piped_chat_keeps_its_history(tiny_model_dir) -> None:
    lines = "hello there\n/stats\nand once more\n/stats\n/bye\n"
    done = subprocess.run(
        [*_cli(tiny_model_dir("llama")), "--max-tokens", "6"],
        input=lines,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, second = _cached(done.stdout)
    assert first == 0 and second > 0  # the second turn reuses the first turn's blocks
    assert ">>>" not in done.stdout  # no prompts when stdin is not a terminal


def test_a_terminal_chat(tiny_model_dir) -> None:
    child = pexpect.spawn(
        sys.executable, ["-m", "tokenmill.cli", "chat", str(tiny_model_dir("llama")), *FLAGS],
        encoding="utf-8", timeout=60,
    )  # fmt: skip
    try:
        child.expect_exact(">>> ")
        child.sendline("/params max_tokens=6")
        child.expect_exact("max_tokens=6")
        child.expect_exact(">>> ")
        child.sendline("hello")
        child.expect_exact(">>> ")
        child.sendline('"""two')
        child.expect_exact("... ")
        child.sendline('lines"""')
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"(\d+) of them cached")
        assert int(child.match.group(1)) > 0
        child.expect_exact(">>> ")
        # Ctrl-C mid-reply stops it and keeps the chat going.
        child.sendline("/params max_tokens=480 ignore_eos=true")
        child.expect_exact(">>> ")
        child.sendline("a long one")
        child.expect_exact("a long one\r\n")  # the terminal's echo
        child.expect(r"\S")  # the reply has begun
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"(\d+) tokens \((\w+)\)")
        assert child.match.group(2) == "abort" and int(child.match.group(1)) < 480
        child.expect_exact(">>> ")
        # Ctrl-C at the prompt is only a reminder.
        child.sendintr()
        child.expect_exact("Ctrl-D or /bye leaves")
        child.sendline("/reset")
        child.expect_exact("cleared")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_args(
        model=str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory="4MiB"
    )


def test_history_beyond_the_context_loses_its_oldest_turns(engine) -> None:
    notices: list[str] = []
    session = ChatSession(engine, notice=notices.append)
    session.set_params(["temperature=0", "max_tokens=4"])
    out: list[str] = []
    for i in range(6):
        assert session.reply(f"message {i} " + "word " * 6, out.append) is not None
    assert any("dropped" in n for n in notices)
    assert session.messages[-2]["content"].startswith("message 5")
    assert len(session.messages) < 12
    assert session.reply("x" * 400, out.append) is None  # alone beyond the context
    assert "shorten it" in notices[-1]
    assert session.messages[-1]["role"] == "assistant"  # the refused message is not kept
    assert_all_blocks_free(engine)


def test_params_save_and_load(engine, tmp_path) -> None:
    session = ChatSession(engine, system="Be brief.")
    with pytest.raises(ValueError, match="unknown parameter 'warmth'"):
        session.set_params(["warmth=1"])
    with pytest.raises(ValueError, match="top_p"):
        session.set_params(["top_p=7"])
    with pytest.raises(ValueError, match="top_k must be a int"):
        session.set_params(["top_k=many"])
    session.set_params(["temperature=0", "max_tokens=3", "seed=5"])
    session.reply("hi", lambda _: None)
    path = tmp_path / "chat.json"
    session.save(str(path))
    other = ChatSession(engine)
    other.load(str(path))
    assert other.messages == session.messages and other.system == "Be brief."
    assert other.settings["seed"] == 5
    path.write_text(json.dumps({"messages": [{"role": "robot"}]}))
    with pytest.raises(ValueError, match="not a saved conversation"):
        other.load(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        other.load(str(tmp_path / "absent.json"))


def test_a_harmony_model_shows_its_answer_and_sends_its_thinking_apart(harmony_model_dir):
    """gpt-oss's channels are special tokens: the terminal shows the answer, the thinking goes
    to stderr, and no markup reaches either, whatever the (random) model writes."""
    engine = LLMEngine.from_args(
        model=str(harmony_model_dir), max_model_len=512, kv_cache_memory="8MiB"
    )
    assert engine.reasoning == "harmony"
    thinking: list[str] = []
    session = ChatSession(engine, notice=lambda _: None, notice_part=thinking.append)
    session.set_params(["temperature=1", "max_tokens=48", "seed=3"])
    shown: list[str] = []
    for i in range(4):
        reply = session.reply(f"question {i}", shown.append)
        assert reply is not None and "<|" not in reply
    assert "<|" not in "".join(shown) + "".join(thinking)
    assert all("<|" not in m["content"] for m in session.messages)
    assert_all_blocks_free(engine)
