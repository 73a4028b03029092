"""Structured outputs through the server and the official openai client (tiny random Llama):
response_format and the guided_* extensions constrain the output, streamed or not; a bad or
unsupported format is a 400 naming the problem, never an unconstrained 200."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from live_server import MODEL_NAME, running_server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Oslo", "Lima", "Pune"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Who?"}]


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with running_server(tiny_model_dir("llama")) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_json_schema_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=150, temperature=1.0, seed=3,
        response_format=RESPONSE_FORMAT,
    )  # fmt: skip
    full = client.chat.completions.create(**kwargs)
    jsonschema.validate(json.loads(full.choices[0].message.content), SCHEMA)
    assert full.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content


def test_completions_json_object_regex_choice(client: openai.OpenAI) -> None:
    base = dict(model=MODEL_NAME, prompt="x", max_tokens=60, temperature=1.0)
    out = client.completions.create(**base, extra_body={"guided_regex": r"[a-z]{3}-[0-9]{3}"})
    assert re.fullmatch(r"[a-z]{3}-[0-9]{3}", out.choices[0].text)
    out = client.completions.create(**base, extra_body={"guided_choice": ["yes", "no"]}, n=4)
    assert {c.text for c in out.choices} <= {"yes", "no"}
    out = client.completions.create(
        **base, extra_body={"response_format": {"type": "json_object"}, "max_tokens": 200}
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:
        assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "xml"}}, "response_format type"),
        ({"guided_regex": "a(b"}, "regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "strnig"),
        ({"guided_grammar": "start: foo"}, "unknown name"),
        ({"guided_choice": []}, "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured output format"),
    ],
)
def test_bad_formats_are_400s(client: openai.OpenAI, extra, message) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=extra
        )
    assert message in exc.value.body["message"]


def test_a_format_that_excludes_the_free_answer_is_enforced(client: openai.OpenAI) -> None:
    """Greedy output without a format, then with a regex its text cannot match: the
    constrained output matches the regex (the request was not served unconstrained)."""
    base = dict(model=MODEL_NAME, prompt="abc", max_tokens=8, temperature=0)
    free = client.completions.create(**base).choices[0].text
    pattern = "Z{3}[0-9]"
    assert not re.fullmatch(pattern, free)
    out = client.completions.create(**base, extra_body={"guided_regex": pattern})
    assert out.choices[0].text == "ZZZ" + out.choices[0].text[3:]
    assert re.fullmatch(pattern, out.choices[0].text)
