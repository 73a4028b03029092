"""Tool calling through the server and the official openai client (tiny random Llama, whose
template has no tool support: the generic prompt). A named function or "required" is enforced
by the grammar, so even random weights produce a call whose arguments validate; streamed calls
are assembled from delta.tool_calls as the SDK does."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from live_server import MODEL_NAME, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z]{1,4}$"},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {"type": "object", "additionalProperties": False}
PING = {"type": "function", "function": {"name": "ping", "parameters": NO_ARGS}}
PONG = {"type": "function", "function": {"name": "pong", "parameters": NO_ARGS}}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME, PING, PONG)}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    # The byte tokenizer spends a token a byte: room for the generic tool prompt.
    with running_server(tiny_model_dir("llama"), engine_overrides={"max_model_len": 512}) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice, names",
    [
        ({"type": "function", "function": {"name": "weather"}}, {"weather"}),
        ("required", {"ping", "pong"}),
    ],
)
def test_enforced_tool_calls_streamed_and_not(client: openai.OpenAI, tool_choice, names) -> None:
    tools = [WEATHER, TIME] if tool_choice != "required" else [PING, PONG]  # prompts fit 512
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice=tool_choice,
        max_tokens=90, temperature=1.0, seed=4, parallel_tool_calls=False,
    )  # fmt: skip
    full = client.chat.completions.create(**kwargs)
    (choice,) = full.choices
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, names)
    assert len(choice.message.tool_calls) == 1
    # Streamed: assemble the calls from their deltas, as client code does.
    assembled: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = assembled.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(e["name"], e["arguments"]) for e in assembled.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_tool_results_in_the_history_are_accepted(client: openai.OpenAI) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "arguments": '{"city": "Oslo", "unit": "C"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ]
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[TIME], max_tokens=8, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_and_none_leave_the_text_free(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice=choice,
            max_tokens=10, temperature=0,
        )  # fmt: skip
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400s(client: openai.OpenAI, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=extra
        )
    assert exc.value.body["param"] == param


LLAMA3_TEMPLATE = (
    "{% if tools %}Functions: {{ tools | tojson }}\n"
    'Call one as {"name": ..., "parameters": ...} (or after <|python_tag|>).\n{% endif %}'
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
)


def test_a_llama3_template_gets_calls_in_its_own_format(tiny_model_dir, tmp_path) -> None:
    """A template that reads tools and speaks Llama 3's JSON calls (<|python_tag|>): the
    grammar writes {"name", "parameters"} objects, which come back as tool_calls."""
    import shutil

    model = tmp_path / "llama3-tools"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA3_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server(model, engine_overrides={"max_model_len": 512}) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        full = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=90,
            tool_choice={"type": "function", "function": {"name": "weather"}}, seed=3,
        )  # fmt: skip
        (choice,) = full.choices
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"weather"})
        for seed in range(4):
            auto = client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=60, seed=seed
            )
            (choice,) = auto.choices
            if choice.message.tool_calls:  # a reply that began with "{" is a valid call
                check_calls(choice.message.tool_calls, {"weather"})
            elif choice.finish_reason == "stop":
                assert not (choice.message.content or "").lstrip().startswith("{")


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_a_tool_result_in_the_history_works_whatever_the_tool_choice(tiny_model_dir, arch) -> None:
    """With tool_choice "none", or no tools at all, a history holding a call and its result
    still renders: Gemma's template (roles must alternate, no tool role) gets them as turns."""
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ]  # fmt: skip
    with running_server(tiny_model_dir(arch), engine_overrides={"max_model_len": 512}) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        for extra in ({"tools": [TIME], "tool_choice": "none"}, {}):
            out = client.chat.completions.create(
                model=MODEL_NAME, messages=history, max_tokens=4, temperature=0, **extra
            )
            assert out.choices[0].message.tool_calls is None
        r = httpx.post(f"{srv.url}/api/chat", json={
            "model": MODEL_NAME, "stream": False, "options": {"num_predict": 4},
            "messages": [history[0],
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
                         {"role": "tool", "content": '{"temp": 3}', "tool_name": "weather"}],
        })  # fmt: skip
        assert r.status_code == 200, r.text
