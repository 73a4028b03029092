"""Speculative decoding through the server and the official openai client (tiny random Llama):
streamed chunks may carry several tokens a step, and what they add up to is the unstreamed
completion; a request can opt out in its body."""

from __future__ import annotations

import openai
import pytest
from live_server import MODEL_NAME, running_server, scrape

# The tiny model's byte tokenizer: a prompt that repeats, so n-gram drafts exist and are kept.
PROMPT = "abcabcabcabcabcabcabcabcabc"


@pytest.fixture(scope="module", params=["ngram", "suffix", "draft"])
def server(request, tiny_model_dir):
    spec = dict(speculative_method=request.param)
    if request.param == "draft":
        spec["draft_num_layers"] = 1
    with running_server(tiny_model_dir("llama"), engine_overrides=spec) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)


def test_streamed_chunks_add_up_to_the_completion(client: openai.OpenAI, server) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens == 40
    drafts = scrape(server.url)["tokenmill:spec_decode_num_draft_tokens_total"]
    assert drafts > 0


def test_opting_out_gives_the_same_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0)
    spec = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    plain = client.completions.create(
        **kwargs, extra_body={"ignore_eos": True, "speculative": False}
    )
    assert spec.choices[0].text == plain.choices[0].text
