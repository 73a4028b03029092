"""A model made from a Modelfile, served pinned (recipes.py; ServerConfig.recipe): its SYSTEM,
MESSAGEs and PARAMETERs reach the OpenAI routes (openai SDK) where a request does not set its
own, and its TEMPLATE is the chat template the engine renders."""

from __future__ import annotations

import openai
import pytest
from live_server import MODEL_NAME, running_server

from tokenmill.recipes import parse_modelfile

MODELFILE = """FROM tiny
PARAMETER num_predict 3
PARAMETER temperature 0
SYSTEM You are Mario.
MESSAGE user Who are you?
MESSAGE assistant Mario.
TEMPLATE \"\"\"{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>\"\"\"
"""
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    recipe = parse_modelfile("mario", MODELFILE)
    with running_server(tiny_model_dir("llama"), {"chat_template": recipe.template},
                        recipe=recipe) as srv:  # fmt: skip
        yield srv


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_the_recipe_applies_where_the_request_sets_nothing(server) -> None:
    reply = _client(server).chat.completions.create(model=MODEL_NAME, messages=USER)
    assert reply.usage.completion_tokens == 3  # PARAMETER num_predict
    rendered = "<system>You are Mario.<user>Who are you?<assistant>Mario.<user>hi<assistant>"
    tokenizer = server.engine.tokenizer
    assert tokenizer.chat_template.startswith("{% for m in messages %}")  # its TEMPLATE
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered))
    again = _client(server).chat.completions.create(model=MODEL_NAME, messages=USER)
    assert again.choices[0].message.content == reply.choices[0].message.content  # temperature 0


def test_a_requests_own_values_win(server) -> None:
    own = [{"role": "system", "content": "Be Luigi."}, *USER]
    reply = _client(server).chat.completions.create(model=MODEL_NAME, messages=own,
                                                    max_tokens=5, temperature=0)  # fmt: skip
    assert reply.usage.completion_tokens == 5
    rendered = "<system>Be Luigi.<user>Who are you?<assistant>Mario.<user>hi<assistant>"
    assert reply.usage.prompt_tokens == len(server.engine.tokenizer.encode(rendered))
    text = _client(server).completions.create(model=MODEL_NAME, prompt="hi")
    assert text.usage.completion_tokens == 3  # completions take its PARAMETERs too
