"""Reasoning models through the server's public doors: the openai SDK's chat (reasoning_content
apart from content, streamed and not, with tools, with a thinking budget, with thinking off)
and the ollama SDK's chat ("think"). The tiny random Qwen3s carry Qwen3's and DeepSeek-R1's
real chat templates; a regex (guided_regex) makes them write known thinking and answers."""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest
from live_server import MODEL_NAME, running_server

USER = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def qwen3(reasoning_model_dir):
    # Qwen3's tool prompt takes ~550 of the byte tokenizer's tokens
    with running_server(reasoning_model_dir("qwen3"), {"max_model_len": 1024}) as srv:
        yield srv


@pytest.fixture(scope="module")
def deepseek(reasoning_model_dir):
    with running_server(reasoning_model_dir("deepseek_r1")) as srv:
        yield srv


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(server, regex: str | None = None, **kwargs):
    extra = dict(kwargs.pop("extra_body", {}))
    if regex is not None:
        extra["guided_regex"] = regex
    return _client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=kwargs.pop("messages", USER),
        temperature=0,
        max_tokens=kwargs.pop("max_tokens", 64),
        extra_body=extra,
        **kwargs,
    )


def _streamed(server, regex: str | None = None, **kwargs) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in _chat(server, regex, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    return reasoning, content


@pytest.mark.parametrize(
    ("kind", "regex"),
    [
        ("qwen3", r"<think>\nParis is the capital\.\n</think>\n\nParis\."),
        ("deepseek", r"Paris is the capital\.\n</think>\n\nParis\."),  # the template opened it
    ],
)
def test_thinking_comes_apart_from_the_answer(request, kind, regex) -> None:
    server = request.getfixturevalue(kind)
    reply = _chat(server, regex)
    message = reply.choices[0].message
    assert message.reasoning_content.strip() == "Paris is the capital."
    assert message.content == "Paris."
    # the thinking's tokens, the closing tag's included: a regex's text comes as the tokenizer
    # writes it, here a byte a token and each tag its one token
    thought = "\nParis is the capital.\n" if kind == "qwen3" else "Paris is the capital.\n"
    assert reply.usage.completion_tokens_details.reasoning_tokens == len(thought) + 1
    reasoning, content = _streamed(server, regex)
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_tool_calls_are_parsed_from_the_answer_only(qwen3) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    thought = "I should call <tool_call> the weather tool."
    regex = r"<think>\n" + _escape(thought) + r"\n</think>\n\n" + _escape(call)
    reply = _chat(qwen3, regex, tools=[WEATHER], max_tokens=160)
    choice = reply.choices[0]
    assert choice.message.reasoning_content.strip() == thought
    assert choice.finish_reason == "tool_calls"
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert tool_call.function.arguments == '{"city": "Paris"}'


def test_thinking_off_through_chat_template_kwargs(qwen3) -> None:
    """Qwen3's enable_thinking: false closes the block in the prompt: all answer."""
    reply = _chat(
        qwen3, r"Paris\.", extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert reply.choices[0].message.content == "Paris."
    assert reply.choices[0].message.reasoning_content is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"chat_template_kwargs": {"custom_template": "{{ 1 }}"}}, "chat_template_kwargs.custom_template"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
        ({"chat_template_kwargs": {"reasoning_effort": "max"}}, "chat_template_kwargs.reasoning_effort"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"max_thinking_tokens": -1}, "max_thinking_tokens"),
    ],
)  # fmt: skip
def test_what_a_template_may_not_be_given_is_a_400(qwen3, kwargs, param) -> None:
    r = httpx.post(
        f"{qwen3.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **kwargs},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("budget", [0, 6])
def test_the_thinking_budget_ends_the_thinking_there(deepseek, budget) -> None:
    """The random model never closes its thinking: the budget does, after ``budget`` tokens;
    then it answers until max_tokens."""
    body = {"max_thinking_tokens": budget, "ignore_eos": True}
    reply = _chat(deepseek, max_tokens=24, extra_body=body)
    usage = reply.usage
    assert usage.completion_tokens == 24
    assert usage.completion_tokens_details.reasoning_tokens == budget + 1  # and the tag
    message = reply.choices[0].message
    assert message.reasoning_content is not None and message.content
    reasoning, content = _streamed(deepseek, max_tokens=24, extra_body=body)
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_a_budget_on_a_model_that_does_not_reason_is_a_400(tiny_model_dir) -> None:
    with (
        running_server(tiny_model_dir("llama")) as server,
        pytest.raises(openai.BadRequestError) as exc,
    ):
        _client(server).chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=4, extra_body={"max_thinking_tokens": 3}
        )
    assert "reasoning model" in str(exc.value)


def test_ollama_think_carries_the_thinking_apart(deepseek, qwen3) -> None:
    """DeepSeek-R1's template opens the block and the random model never closes it: with
    "think": true all it writes is message.thinking; without, it is content as it was."""
    client = ollama.Client(host=deepseek.url)
    options = {"temperature": 0, "num_predict": 8}
    thought = client.chat(MODEL_NAME, messages=USER, think=True, options=options)
    assert thought.message.thinking and thought.message.content == ""
    plain = client.chat(MODEL_NAME, messages=USER, options=options)
    assert plain.message.thinking is None and plain.message.content == thought.message.thinking
    streamed = "".join(
        part.message.thinking or ""
        for part in client.chat(MODEL_NAME, messages=USER, think=True, options=options, stream=True)
    )
    assert streamed == thought.message.thinking
    # Qwen3's thinking switch through Ollama's field; a level it does not know is a 400
    off = ollama.Client(host=qwen3.url).chat(
        MODEL_NAME, messages=USER, think=False, options=options
    )
    assert off.message.thinking is None
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(MODEL_NAME, messages=USER, think="extreme")
    assert exc.value.status_code == 400


def _escape(text: str) -> str:
    import re

    return re.escape(text)
