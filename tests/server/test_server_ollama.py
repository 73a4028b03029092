"""Ollama's API, driven by the official ``ollama`` Python client against a real server (tiny
random Llama, loopback port): chat, streamed chat, generate with context, list, show, ps, and
errors in Ollama's shape."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from live_server import MODEL_NAME, running_server, scrape

API_KEY = "sk-ollama-test"
GREEDY = {"temperature": 0, "num_predict": 8}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(
        tiny_model_dir("llama"), engine_overrides={"max_model_len": 512}, api_keys=(API_KEY,)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


def test_list_show_ps_and_version(client: ollama.Client, server) -> None:
    (model,) = client.list().models
    assert model.model == MODEL_NAME
    assert model.details.family == "llama" and model.details.format == "safetensors"
    assert model.details.parameter_size.endswith("M") and model.size > 0
    shown = client.show(MODEL_NAME)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 512
    assert shown.modelinfo["general.parameter_count"] > 0
    assert "completion" in shown.capabilities
    assert shown.template  # the chat template the model is prompted with
    (running,) = client.ps().models
    assert running.model == MODEL_NAME and running.size > 0
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server.url}/api/version", headers=auth).json()["version"]


def test_chat_streamed_equals_not_streamed(client: ollama.Client, server) -> None:
    itls = "tokenmill:inter_token_latency_seconds_count"
    before = scrape(server.url, {"Authorization": f"Bearer {API_KEY}"}).get(itls, 0)
    full = client.chat(MODEL_NAME, messages=MESSAGES, options=GREEDY)
    # Sent whole, its output is built once (final-only); its 7 gaps are timed all the same.
    after = scrape(server.url, {"Authorization": f"Bearer {API_KEY}"}).get(itls, 0)
    assert after - before == 7
    assert full.message.role == "assistant" and full.message.content
    assert full.done and full.done_reason == "length"
    assert full.eval_count == 8 and full.prompt_eval_count > 5
    assert full.total_duration >= full.eval_duration > 0
    chunks = list(client.chat(MODEL_NAME, messages=MESSAGES, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == full.message.content
    assert chunks[-1].eval_count == 8


def test_generate_continues_from_its_context(client: ollama.Client) -> None:
    first = client.generate(MODEL_NAME, "Once upon a time", options=GREEDY)
    assert first.done_reason == "length" and first.response
    assert len(first.context) == first.prompt_eval_count + 8
    more = client.generate(MODEL_NAME, " then", context=first.context, options=GREEDY)
    assert more.prompt_eval_count > len(first.context)
    chunks = list(client.generate(MODEL_NAME, "Once upon a time", options=GREEDY, stream=True))
    assert "".join(c.response for c in chunks) == first.response
    # The stream's last object counts and carries all of it, as the whole reply does.
    assert (chunks[-1].eval_count, chunks[-1].context) == (8, first.context)
    raw = client.generate(MODEL_NAME, "abc", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < first.prompt_eval_count  # no chat template around it


def test_options_map_to_sampling(client: ollama.Client) -> None:
    seeded = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 7, "num_predict": 10}
    a = client.generate(MODEL_NAME, "Hi", options=seeded).response
    b = client.generate(MODEL_NAME, "Hi", options=seeded).response
    assert a == b
    greedy = client.generate(MODEL_NAME, "Hi", options={**GREEDY, "num_predict": 30}).response
    stop = greedy[6:8]
    stopped = client.generate(
        MODEL_NAME, "Hi", options={**GREEDY, "num_predict": 30, "stop": [stop]}
    )
    assert stopped.done_reason == "stop"
    assert stopped.response == greedy[: greedy.index(stop)]
    # Runtime options of llama.cpp are accepted and change nothing.
    same = client.generate(MODEL_NAME, "Once upon a time", options={**GREEDY, "num_thread": 2})
    assert same.response == client.generate(MODEL_NAME, "Once upon a time", options=GREEDY).response


def test_format_json_constrains_the_output(client: ollama.Client) -> None:
    out = client.generate(MODEL_NAME, "A person:", format="json", options={"num_predict": 24})
    assert out.response.lstrip().startswith("{")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = client.chat(
        MODEL_NAME, messages=MESSAGES, format=schema, options={"temperature": 0, "num_predict": 40}
    )
    if out.done_reason == "stop":
        assert isinstance(json.loads(out.message.content)["a"], int)
    else:
        assert out.message.content.startswith('{"a": ')


@pytest.mark.parametrize(
    ("call", "status", "needle"),
    [
        (lambda c: c.chat("llama3:8b", messages=MESSAGES), 404, "model 'llama3:8b' not found"),
        (lambda c: c.generate(MODEL_NAME, "x", options={"temperature": "hot"}), 400, "temperature"),
        (lambda c: c.generate(MODEL_NAME, "x", options={"mirostat": 2}), 400, "mirostat"),
        (lambda c: c.generate(MODEL_NAME, "x", options={"num_predict": 0}), 400, "num_predict"),
        (lambda c: c.generate(MODEL_NAME, "x", options={"top_p": 3.0}), 400, "top_p"),
        (lambda c: c.generate(MODEL_NAME, "x " * 300), 400, "context"),
        (lambda c: c.generate(MODEL_NAME, "x", images=["aGk="]), 400, "images"),
        (lambda c: c.chat(MODEL_NAME, messages=MESSAGES, think=True), 400, "thinking"),
    ],
    ids=["model", "type", "mirostat", "num_predict", "top_p", "context", "images", "think"],
)  # fmt: skip
def test_bad_requests_get_ollama_errors(client: ollama.Client, call, status, needle) -> None:
    with pytest.raises(ollama.ResponseError) as exc:
        call(client)
    assert exc.value.status_code == status
    assert needle in exc.value.error, exc.value.error


def test_errors_of_requests_the_client_would_not_send(server) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(
        f"{server.url}/api/generate",
        json={"model": MODEL_NAME, "prompt": "x", "format": "yaml"},
        headers=auth,
    )
    assert r.status_code == 400 and "format" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/chat", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/chat", json={"messages": []}, headers=auth)
    assert r.status_code == 400 and "'model' is required" in r.json()["error"]


def test_the_api_key_guards_the_ollama_routes_too(server) -> None:
    anonymous = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as exc:
        anonymous.list()
    assert exc.value.status_code == 401 and "API key" in exc.value.error
    r = httpx.post(f"{server.url}/api/generate", content=b"{not json")
    assert r.status_code == 401  # auth first, as on the OpenAI routes


def test_an_empty_request_only_loads_the_model(client: ollama.Client) -> None:
    loaded = client.generate(MODEL_NAME, "")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_a_stream_left_early_frees_its_request(client: ollama.Client, server) -> None:
    with httpx.stream(
        "POST",
        f"{server.url}/api/generate",
        json={"model": MODEL_NAME, "prompt": "Hello", "options": {"num_predict": 200}},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        first = json.loads(next(r.iter_lines()))
        assert first["done"] is False and "response" in first
    # The server keeps serving, and nothing is left running.
    assert client.generate(MODEL_NAME, "Hi", options=GREEDY).eval_count == 8
    metrics = httpx.get(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    ).text
    running = [
        line for line in metrics.splitlines() if line.startswith("tokenmill:num_requests_running")
    ]
    assert running and running[0].endswith(" 0.0")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_chat_with_tools_prompts_them_and_takes_their_results(client: ollama.Client) -> None:
    plain = client.chat(MODEL_NAME, messages=MESSAGES, options=GREEDY)
    with_tools = client.chat(MODEL_NAME, messages=MESSAGES, tools=[WEATHER], options=GREEDY)
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 20  # the functions
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"sky": "clear"}', "tool_name": "get_weather"},
    ]
    answer = client.chat(MODEL_NAME, messages=turns, tools=[WEATHER], options=GREEDY)
    assert answer.done and answer.eval_count == 8
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(MODEL_NAME, messages=MESSAGES, tools=[{"type": "function"}])
    assert exc.value.status_code == 400


def test_tool_calls_in_the_output_become_message_tool_calls() -> None:
    """The final object parses held-back text into Ollama's tool_calls (arguments as objects);
    plain text streams as it comes."""
    from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from tokenmill.server.ollama import _Chunks

    def output(text: str) -> RequestOutput:
        return RequestOutput(
            request_id="r",
            prompt=None,
            prompt_token_ids=[1],
            outputs=[CompletionOutput(index=0, text=text, token_ids=[5], finish_reason="stop")],
            finished=True,
            metrics=RequestMetrics(arrival_time=0.0, first_token_time=0.1, finished_time=0.2),
        )

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chunks = _Chunks("m", [1], chat=True, parser="hermes")
    sent = [chunks.streamed(piece) for piece in (call[:9], call[9:30], call[30:])]
    assert sent == ["", "", ""]  # held: it may be (and is) a call
    final = chunks.final(output(call), "")
    assert final["message"]["content"] == ""
    assert final["message"]["tool_calls"] == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    chunks = _Chunks("m", [1], chat=True, parser="hermes")
    assert chunks.streamed("Hello") == "Hello"  # cannot begin a call: streams at once
    assert "tool_calls" not in chunks.final(output("Hello"), "")["message"]
