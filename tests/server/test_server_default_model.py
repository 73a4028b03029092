"""The default model as a new user meets it: the README's `tokenmill serve`, then the openai
SDK's chat call, answers a short reply that ends by itself (finish_reason "stop"); `tokenmill
chat` on it returns to its prompt; a JSON schema's reply ends and validates on every prompt
(its numbers bounded: structured/json_numbers.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
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


COUNTRY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "continent": {
            "type": "string",
            "enum": ["Africa", "Asia", "Europe", "North America", "South America", "Oceania"],
        },
        "languages": {
            "type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4,
        },
    },
    "required": ["name", "population_millions", "continent", "languages"],
    "additionalProperties": False,
}  # fmt: skip
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Germany", "Mexico",
             "Egypt", "Australia", "Spain", "Chile", "Nigeria", "Thailand", "Sweden", "Peru",
             "Vietnam", "Italy", "Morocco", "Norway"]  # fmt: skip


def test_a_json_schema_reply_ends_and_validates_on_every_prompt(server) -> None:
    """Unbounded, 3 of these 20 ran a number ("11111111111...") to max_tokens."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "country", "schema": COUNTRY}}

    def ask(country: str):
        content = (
            f"Describe {country} as JSON: its name, population in millions, continent and "
            "main languages."
        )
        return client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": content}],
            temperature=0, max_tokens=200, response_format=fmt,
        ).choices[0]  # fmt: skip

    with ThreadPoolExecutor(len(COUNTRIES)) as pool:
        choices = list(pool.map(ask, COUNTRIES))
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), COUNTRY)
