"""The official openai client against a real server (tiny random Llama, loopback port)."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL_NAME, running_server

API_KEY = "sk-test-key"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something."},
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama"), api_keys=(API_KEY,)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def _token_id(server, text: str) -> int:
    r = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": text, "add_special_tokens": False},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    (token_id,) = r.json()["tokens"]
    return token_id


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.body["code"] == "model_not_found"


def test_chat_streamed_equals_not_streamed(client: openai.OpenAI, server) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    (choice,) = full.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    prompt_len = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": MESSAGES},
        headers={"X-Api-Key": API_KEY},
    ).json()["count"]
    assert full.usage.prompt_tokens == prompt_len
    assert full.usage.total_tokens == prompt_len + 12
    assert full.model_extra["timings"]["ttft_s"] > 0

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=3, stream=True)
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_completions_n2_seeded_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1]
    assert full.usage.completion_tokens == 16
    texts = {c.index: c.text for c in full.choices}
    assert client.completions.create(**kwargs).choices[0].text == texts[0]  # seeded: repeatable

    streamed = {0: "", 1: ""}
    finished = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert streamed == texts
    assert finished == {0: "length", 1: "length"}


def test_completions_prompt_list_and_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=["ab", "cd"], max_tokens=4, temperature=0, n=2
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1]  # greedy siblings agree
    ids = client.completions.create(model=MODEL_NAME, prompt=[1, 70, 71], max_tokens=4)
    assert ids.usage.prompt_tokens == 3


def test_stop_strings(client: openai.OpenAI) -> None:
    base = dict(model=MODEL_NAME, prompt="The sea", max_tokens=24, temperature=0)
    text = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    # A stop string that first appears inside the text: an ASCII character not seen before.
    idx = next(
        i for i in range(1, len(text)) if text[i].isascii() and text[i].isalnum()
        and text[i] not in text[:i]
    )  # fmt: skip
    stop = text[idx]
    out = client.completions.create(**base, stop=[stop, "never-there"])
    assert out.choices[0].text == text[:idx]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(
        **base, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == text[: idx + 1]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**base, stop=[stop], stream=True)
    )
    assert streamed == text[:idx]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for pos in content:
        assert len(pos.top_logprobs) == 3
        tops = [t.logprob for t in pos.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert pos.token == pos.top_logprobs[0].token  # greedy picks the top token
        assert pos.logprob == pytest.approx(tops[0])
        assert pos.bytes is None or pos.bytes == list(pos.token.encode())

    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [p.token for p in streamed] == [p.token for p in content]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3  # tokens with the same text (e.g. U+FFFD) share a key
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))


def test_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="xyz", max_tokens=3, echo=True)
    assert out.choices[0].text.startswith("xyz")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL_NAME, prompt="xyz", max_tokens=3, echo=True, stream=True
        )
    )
    assert streamed.startswith("xyz")


def test_logit_bias_forces_a_token(client: openai.OpenAI, server) -> None:
    token_a = _token_id(server, "a")
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.7,
        seed=1,
        logit_bias={str(token_a): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == "aaaaa"


def test_api_key_rejected(server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.status_code == 401
    assert exc.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
