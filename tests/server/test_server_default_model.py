"""The default model as a new user meets it: the README's `tokenmill serve`, then the openai
SDK's chat call, answers a short reply that ends by itself (finish_reason "stop"); `tokenmill
chat` on it returns to its prompt."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from live_server import LiveServer

from tokenmill.config import EngineArgs
from tokenmill.embedded import DEFAULT_MODEL
from tokenmill.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(max_model_len=1024, kv_cache_memory="64MiB")  # the default model
    assert args.model == DEFAULT_MODEL
    srv = LiveServer(lambda: AsyncEngine.from_args(args), served_model_name=DEFAULT_MODEL)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_a_chat_reply_ends_by_itself(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=200,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert "Paris" in choice.message.content
    assert reply.usage.completion_tokens < 100


def test_tokenmill_chat_on_the_default_comes_back() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "chat", "--max-model-len", "1024",
         "--kv-cache-memory", "64MiB", "--temperature", "0"],
        input="What is the capital of France?\n/params\n",
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "max_tokens=512" in result.stdout  # the cap /params shows
