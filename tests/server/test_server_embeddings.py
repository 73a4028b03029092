"""Embeddings through the server's public doors: the openai SDK's embeddings.create (base64,
its default, and float; texts and token ids; dimensions) and the ollama SDK's embed, against
transformers' vectors for the same tokens on a tiny random embedding checkpoint (Qwen3 with
sentence-transformers' last-token pooling and Normalize, as Qwen3-Embedding ships); metering,
and 400s for bad inputs and for the wrong kind of server."""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest
import torch
from live_server import MODEL_NAME, running_server, scrape

KEY = "sk-embed-test"
TEXTS = ["a cat sat on the mat", "dogs", "x" * 40]


@pytest.fixture(scope="module")
def server(embedding_model_dir):
    with running_server(embedding_model_dir("last"), {"max_model_len": 128},
                        api_keys=(KEY,)) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(embedding_model_dir):
    """Transformers' last-token pooled, normalized vector of a list of token ids."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(embedding_model_dir("last"), dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden[-1], dim=0)

    return embed


def _ids(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    return r.json()["tokens"]


def test_vectors_equal_transformers(client, server, reference) -> None:
    reply = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the SDK asks for base64
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    ids = [_ids(server, text) for text in TEXTS]
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    for got, as_float, tokens in zip(reply.data, floats.data, ids):
        want = reference(tokens)
        torch.testing.assert_close(torch.tensor(got.embedding), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(as_float.embedding), want, atol=1e-4, rtol=1e-4)
    # Token ids: the same vectors (up to the batch's and the prefix cache's rounding).
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    for got, as_float in zip(by_ids.data, floats.data):
        assert got.embedding == pytest.approx(as_float.embedding, abs=1e-5)
    one = client.embeddings.create(model=MODEL_NAME, input=ids[1], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(floats.data[1].embedding, abs=1e-5)


def test_dimensions_truncate_and_renormalize(client, server, reference) -> None:
    reply = client.embeddings.create(model=MODEL_NAME, input="dogs", dimensions=16)
    want = torch.nn.functional.normalize(reference(_ids(server, "dogs"))[:16], dim=0)
    torch.testing.assert_close(torch.tensor(reply.data[0].embedding), want, atol=1e-4, rtol=1e-4)


def test_ollama_embed(server, reference) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    client = ollama.Client(host=server.url, headers=headers)
    reply = client.embed(model=MODEL_NAME, input=TEXTS[:2])
    assert reply.prompt_eval_count == sum(len(_ids(server, t)) for t in TEXTS[:2])
    for got, text in zip(reply.embeddings, TEXTS[:2]):
        torch.testing.assert_close(torch.tensor(got), reference(_ids(server, text)),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
    legacy = client.embeddings(model=MODEL_NAME, prompt=TEXTS[0])
    assert legacy.embedding == pytest.approx(reply.embeddings[0], abs=1e-6)
    # truncate (Ollama's default) cuts an input to the context; false refuses it
    long = "y" * 300
    assert len(client.embed(model=MODEL_NAME, input=long).embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model=MODEL_NAME, input=long, truncate=False)
    assert exc.value.status_code == 400


def test_embeddings_are_metered(client, server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    before = scrape(server.url, auth)["tokenmill:prompt_tokens_total"]
    reply = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    after = scrape(server.url, auth)["tokenmill:prompt_tokens_total"]
    assert after - before == reply.usage.prompt_tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "dogs", "dimensions": 0}, "dimensions"),
        ({"input": "dogs", "dimensions": 65}, "dimensions"),
        ({"input": [[1, 99999]]}, "input"),
        ({"input": "z" * 300}, "input"),
        ({"input": "dogs", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_inputs_are_400s(server, body, param) -> None:
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL_NAME, **body},
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_embedding_server_refuses_generation_and_back(client, tiny_model_dir) -> None:
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    with running_server(tiny_model_dir("llama")) as srv:
        plain = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--task embed"):
            plain.embeddings.create(model=MODEL_NAME, input="hi")
    with running_server(tiny_model_dir("llama"), {"task": "embed"}) as srv:
        embed = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        assert len(embed.embeddings.create(model=MODEL_NAME, input="hi").data[0].embedding) == 64
