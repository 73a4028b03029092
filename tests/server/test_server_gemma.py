"""The embedded gemma-3-270m through the server: chat and completion, streamed and not.

The engine's greedy output is checked against transformers in tests/e2e; here the server must
give exactly what the engine gives for the same tokens (chat template, detokenization, SSE).
Few tokens per request: a CPU step of this model takes a fraction of a second.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from live_server import LiveServer

from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NAME = "gemma-3-270m"
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(model=NAME, max_model_len=512, kv_cache_memory="64MiB")
    srv = LiveServer(lambda: AsyncEngine.from_args(args), served_model_name=NAME).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_gemma_chat_and_completion_streamed(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    tokenizer = server.engine.tokenizer

    prompt = "The capital of France is"
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0)
    full = client.completions.create(**kwargs)
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == NUM_TOKENS
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == full.choices[0].text and streamed.strip()

    messages = [{"role": "user", "content": "Name a colour."}]
    chunks = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=NUM_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt_ids = tokenizer.encode_chat(messages)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert "<start_of_turn>" not in content and "<end_of_turn>" not in content

    async def reference() -> str:
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
        text = ""
        async for out in server.engine.generate(prompt_ids, params):
            text += out.outputs[0].text_delta
        return text

    assert content == asyncio.run(reference())
    server.wait_idle()


def test_gemma_chat_json_schema(server) -> None:
    """A chat request with a json_schema for {name, age, city} returns valid JSON, streamed
    and not."""
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "city": {"type": "string"},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model=NAME,
        messages=[{"role": "user", "content": "Describe a person who lives in Lima, as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
    )
    full = client.chat.completions.create(**kwargs)
    (choice,) = full.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    chunks = client.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        choice.message.content
    )


def test_gemma_named_tool_call_streamed_and_not(server) -> None:
    """tool_choice naming a function returns a parsed tool_calls entry whose arguments
    validate against its parameters, streamed (assembled from deltas) and not."""
    import json

    import jsonschema

    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather", "parameters": params},
    }
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model=NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    full = client.chat.completions.create(**kwargs)
    (choice,) = full.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)
    streamed = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed["name"] += d.function.name or ""
            streamed["arguments"] += d.function.arguments or ""
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}
