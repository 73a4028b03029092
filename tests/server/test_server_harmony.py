"""gpt-oss's harmony format through the server's public doors: the openai SDK's chat
(reasoning_content from the analysis channel, content from the final one, streamed and not; a
call on the commentary channel as tool_calls, and a conversation that sends it back) and the
ollama SDK's chat (no markup reaches it; "think" alone shows thinking). The tiny random
gpt-oss is made to write harmony by a grammar over its special tokens (guided_grammar)."""

from __future__ import annotations

import json

import ollama
import openai
import pytest
from live_server import MODEL_NAME, running_server
from test_server_reasoning import USER, WEATHER

ANSWER = (
    'start: <|channel|> "analysis" <|message|> "The capital is Paris." <|end|> <|start|> '
    '"assistant" <|channel|> "final" <|message|> "Paris." <|return|>'
)
CALL = (
    'start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> <|start|> '
    '"assistant" <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" '
    '<|message|> "{\\"city\\": \\"Paris\\"}" <|call|>'
)


@pytest.fixture(scope="module")
def server(harmony_model_dir):
    with running_server(harmony_model_dir, {"max_model_len": 512}) as srv:
        yield srv


def _chat(server, grammar: str, **kwargs):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=MODEL_NAME, messages=kwargs.pop("messages", USER), temperature=0, max_tokens=200,
        extra_body={"guided_grammar": grammar}, **kwargs,
    )  # fmt: skip


def test_thinking_and_answer_apart(server) -> None:
    reply = _chat(server, ANSWER)
    message = reply.choices[0].message
    assert message.reasoning_content == "The capital is Paris."
    assert message.content == "Paris." and reply.choices[0].finish_reason == "stop"
    reasoning, content = "", ""
    for chunk in _chat(server, ANSWER, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("The capital is Paris.", "Paris.")
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0


def test_a_call_and_its_answer(server) -> None:
    reply = _chat(server, CALL, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.reasoning_content == "Need the weather."
    history = [*USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
    after = _chat(server, ANSWER, tools=[WEATHER], messages=history)
    assert after.choices[0].message.content == "Paris."
    streamed = {}
    for chunk in _chat(server, CALL, tools=[WEATHER], stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            streamed = delta_call.function.model_dump()
    assert streamed["name"] == "get_weather"


def test_ollama_chat_never_shows_harmonys_markup(server) -> None:
    """Ollama's routes take no grammar, so the random model writes what it will: whatever it
    is, no channel markup reaches the client, and "think" alone shows thinking."""
    client = ollama.Client(host=server.url)
    options = {"temperature": 1.0, "num_predict": 48, "seed": 3}
    for think in (True, False, None):
        reply = client.chat(model=MODEL_NAME, messages=USER, think=think, options=options)
        assert "<|" not in (reply.message.content or "") + (reply.message.thinking or "")
        if not think:
            assert not reply.message.thinking
