"""``tokenmill serve --core-process`` through the official openai client: the engine core in a
process of its own serves what the in-process core serves, streams and structured outputs
too, and an abandoned
stream leaves nothing held."""

from __future__ import annotations

import asyncio

import openai
import pytest
from live_server import MODEL_NAME, running_server

PROMPTS = ["Once upon a time", "1, 2, 3,", "The weather today", "abc"]


def completions(url: str) -> dict[str, list[str]]:
    """Each prompt's completion, whole, streamed and as a JSON schema's object, 12 at once."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model=MODEL_NAME, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})

    async def whole(prompt: str) -> str:
        return (await client.completions.create(prompt=prompt, **kwargs)).choices[0].text

    async def streamed(prompt: str) -> str:
        stream = await client.completions.create(prompt=prompt, stream=True, **kwargs)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def formatted(prompt: str) -> str:  # a structured output: compiled in the core too
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        body = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
        kwargs_ = kwargs | {"extra_body": body, "max_tokens": 24}
        return (await client.completions.create(prompt=prompt, **kwargs_)).choices[0].text

    async def all_of_them() -> dict[str, list[str]]:
        kinds = (whole, streamed, formatted)
        texts = await asyncio.gather(*(f(p) for p in PROMPTS for f in kinds))
        return {p: texts[3 * i : 3 * i + 3] for i, p in enumerate(PROMPTS)}

    return asyncio.run(all_of_them())


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def test_serves_what_the_in_process_core_serves(model) -> None:
    with running_server(model) as local:
        want = completions(local.url)
    with running_server(model, engine_overrides={"core_process": True}) as server:
        got = completions(server.url)
        server.wait_idle()
        server.engine.engine.shutdown()
    assert got == want
    assert all(whole == streamed for whole, streamed, _ in got.values())
    assert all(formatted.startswith('{"n": ') for _, _, formatted in got.values())


def test_a_stream_closed_early_frees_its_request(model) -> None:
    with running_server(model, engine_overrides={"core_process": True}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model=MODEL_NAME, prompt="Hello", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        stream.close()  # the client goes away mid-stream: the server aborts the request
        server.wait_idle()
        assert server.engine.stats.num_running == 0
        server.engine.engine.shutdown()
