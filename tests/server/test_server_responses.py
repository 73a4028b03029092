"""OpenAI's Responses API through the openai SDK: plain and streamed replies, a function-call
round trip (by items and by previous_response_id), a json_schema format, reasoning items, the
store (retrieve, delete, per key), and 400s naming the field."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from live_server import MODEL_NAME, running_server, scrape

KEY, OTHER_KEY, METERED_KEY = "sk-responses-test", "sk-responses-other", "sk-responses-meter"
QUESTION = "What is the weather in Oslo?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def server(reasoning_model_dir):
    # The tiny Qwen3 with Qwen3's template (tools in its own format) and room for a round trip.
    model = reasoning_model_dir("qwen3")
    with running_server(
        model, {"max_model_len": 2048}, api_keys=(KEY, OTHER_KEY, METERED_KEY)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_a_plain_reply_and_its_stream_agree(client) -> None:
    kwargs = dict(model=MODEL_NAME, input=QUESTION, instructions="Be brief.",
                  max_output_tokens=12, temperature=0)  # fmt: skip
    reply = client.responses.create(**kwargs)
    assert reply.object == "response" and reply.output_text
    assert reply.status in ("completed", "incomplete")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
        assert reply.usage.output_tokens == 12
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # As OpenAI's: a reply cut by max_output_tokens ends in response.incomplete, which the
    # SDK's get_final_response does not take; the last event carries the response either way.
    final = events[-1].response
    assert events[-1].type == f"response.{reply.status}" and final.status == reply.status
    assert "".join(deltas) == reply.output_text == final.output_text
    assert final.usage.output_tokens == reply.usage.output_tokens


def test_stream_events_come_in_order(client) -> None:
    events = list(client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=4,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opened = kinds.index("response.output_item.added")
    assert kinds[opened + 1] == "response.content_part.added"
    assert kinds[-4:-1] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done"
    ]  # fmt: skip


def test_a_function_call_round_trip(client) -> None:
    first = client.responses.create(
        model=MODEL_NAME, input=QUESTION, max_output_tokens=140, temperature=0, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3 C, rain"}
    # The whole history as items, stateless ...
    items = [{"role": "user", "content": QUESTION}, *[o.model_dump() for o in first.output],
             result]  # fmt: skip
    by_items = client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=8,
                                       temperature=0, tools=[WEATHER], tool_choice="none",
                                       store=False)  # fmt: skip
    # ... and the same continued from the stored first response.
    by_id = client.responses.create(model=MODEL_NAME, previous_response_id=first.id,
                                    input=[result], max_output_tokens=8, temperature=0,
                                    tools=[WEATHER], tool_choice="none")  # fmt: skip
    assert by_items.output_text and by_id.output_text == by_items.output_text
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    with client.responses.stream(
        model=MODEL_NAME, input=QUESTION, max_output_tokens=140, temperature=0, tools=[WEATHER],
        tool_choice="required",
    ) as stream:  # fmt: skip
        arguments = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.name == "get_weather" and streamed.arguments == arguments


def test_a_json_schema_format(client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    reply = client.responses.create(
        model=MODEL_NAME, input="Name a city.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )  # fmt: skip
    value = json.loads(reply.output_text)
    assert set(value) == {"city"} and len(value["city"]) <= 6


def test_the_store_keeps_responses_per_key(client, server) -> None:
    reply = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(reply.id).output_text == reply.output_text
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError) as exc:
        other.responses.create(model=MODEL_NAME, input="Hi", previous_response_id=reply.id)
    assert exc.value.body["param"] == "previous_response_id"
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    unstored = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2,
                                       store=False)  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_and_messages_are_metered_and_counted(server) -> None:
    auth = {"Authorization": f"Bearer {METERED_KEY}"}
    before = scrape(server.url, auth)
    reply = openai.OpenAI(base_url=f"{server.url}/v1", api_key=METERED_KEY, max_retries=0)
    response = reply.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3)
    message = anthropic.Anthropic(base_url=server.url, api_key=METERED_KEY, max_retries=0)
    answer = message.messages.create(model=MODEL_NAME, max_tokens=3,
                                     messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    want = {
        "requests": 2,
        "prompt_tokens": response.usage.input_tokens + answer.usage.input_tokens,
        "completion_tokens": response.usage.output_tokens + answer.usage.output_tokens,
    }
    deadline = time.monotonic() + 10
    while True:  # metered when each run closes, read after the next flush
        total = httpx.get(f"{server.url}/v1/usage", headers=auth).json()["total"]
        if total["requests"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert {k: total[k] for k in want} == want
    after = scrape(server.url, auth)
    name = "tokenmill:prompt_tokens_total"
    assert after[name] - before[name] == want["prompt_tokens"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "Hi", "max_output_tokens": 0}, "max_completion_tokens"),
        ({"input": "Hi", "frequency": 1}, "frequency"),
        ({"input": []}, "input"),
    ],
)  # fmt: skip
def test_bad_bodies_are_400s_naming_the_field(server, body, param) -> None:
    r = httpx.post(f"{server.url}/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL_NAME, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_reasoning_comes_as_a_reasoning_item(reasoning_model_dir) -> None:
    # DeepSeek-R1's template opens <think> in the prompt; the budget closes it after 6 tokens.
    with running_server(reasoning_model_dir("deepseek_r1")) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        kwargs = dict(model=MODEL_NAME, input="Hi", max_output_tokens=24, temperature=0,
                      extra_body={"max_thinking_tokens": 6})  # fmt: skip
        reply = client.responses.create(**kwargs)
        reasoning, *rest = reply.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text
        assert reply.usage.output_tokens_details.reasoning_tokens == 7  # 6 and </think>
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        final = events[-1].response
        assert thought == reasoning.content[0].text
        assert final.output_text == reply.output_text
