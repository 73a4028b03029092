"""Anthropic's Messages API through the anthropic SDK: plain and streamed replies, a tool round
trip (tool_use -> tool_result -> answer), stop sequences, count_tokens, keys as x-api-key, and
Anthropic's error shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from live_server import MODEL_NAME, running_server

KEY = "sk-anthropic-test"
# The SDK no longer takes temperature; the API (and this server) still does.
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def server(reasoning_model_dir):
    # The tiny Qwen3 with Qwen3's template (tools in its own format) and room for a round trip.
    model = reasoning_model_dir("qwen3")
    with running_server(model, {"max_model_len": 2048}, api_keys=(KEY,)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_a_plain_reply_and_its_stream_agree(client) -> None:
    kwargs = dict(model=MODEL_NAME, max_tokens=12, messages=USER, extra_body=GREEDY,
                  system="Be brief.")  # fmt: skip
    reply = client.messages.create(**kwargs)
    assert reply.type == "message" and reply.role == "assistant"
    (block,) = reply.content
    assert block.type == "text" and block.text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.output_tokens == 12 or reply.stop_reason == "end_turn"
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text and final.content[0].text == block.text
    assert (
        final.stop_reason == reply.stop_reason
        and final.usage.output_tokens == reply.usage.output_tokens
    )


def test_a_stop_sequence_ends_the_reply(client) -> None:
    plain = client.messages.create(
        model=MODEL_NAME, max_tokens=12, messages=USER, extra_body=GREEDY
    )
    text = plain.content[0].text
    stop = text[3:5]
    reply = client.messages.create(
        model=MODEL_NAME, max_tokens=12, messages=USER, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert "".join(b.text for b in reply.content) == text[: text.index(stop)]


def test_a_tool_round_trip(client) -> None:
    first = client.messages.create(
        model=MODEL_NAME, max_tokens=140, messages=USER, extra_body=GREEDY, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)
    history = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "3 degrees, rain"}]},
    ]  # fmt: skip
    for choice in ({"type": "auto"}, {"type": "none"}):
        answer = client.messages.create(
            model=MODEL_NAME, max_tokens=8, messages=history, extra_body=GREEDY, tools=[WEATHER],
            tool_choice=choice,
        )  # fmt: skip
        assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(
        model=MODEL_NAME, max_tokens=140, messages=USER, extra_body=GREEDY, tools=[WEATHER],
        tool_choice={"type": "any"},
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    streamed_call = next(b for b in final.content if b.type == "tool_use")
    assert streamed_call.name == "get_weather" and final.stop_reason == "tool_use"


def test_count_tokens(client, server) -> None:
    count = client.messages.count_tokens(model=MODEL_NAME, messages=USER)
    reply = client.messages.create(model=MODEL_NAME, max_tokens=1, messages=USER)
    assert count.input_tokens == reply.usage.input_tokens > 0


def test_errors_are_anthropics(client, server) -> None:
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL_NAME, max_tokens=0, messages=USER)
    assert exc.value.body["type"] == "error"
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY},
                   json={"model": MODEL_NAME, "max_tokens": 4, "messages": [
                       {"role": "user", "content": [{"type": "image", "source": {}}]}]})  # fmt: skip
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=4, messages=USER
        )
