"""Scoring through /v1/completions, as evaluation harnesses do: echo with logprobs gives the
prompt's tokens and log-probs (the first null) before the completion's; max_tokens 0 scores
without generating. Checked against the engine's own prompt log-probs and transformers."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch
from live_server import MODEL_NAME, running_server

from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

CONTEXT, CONTINUATION = "The capital of France is", " Paris"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir("llama"), {"packed_activations": "float32"}) as srv:
        yield srv


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_echo_scores_the_prompt_without_generating(server) -> None:
    prompt = CONTEXT + CONTINUATION
    reply = _client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    lp = choice.logprobs
    ids = server.engine.tokenizer.encode(prompt)
    assert len(lp.tokens) == len(ids) == reply.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens).endswith(prompt)
    # the engine's own prompt log-probs, position by position
    own = LLM(str(server.engine.info.model_path), max_model_len=256, kv_cache_memory="8MiB",
              packed_activations="float32")  # fmt: skip
    (out,) = own.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))
    want = [None] + [e.sampled.logprob for e in out.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)


def test_a_harness_request_sums_the_continuations_log_probs(server, tiny_model_dir) -> None:
    """lm-evaluation-harness style: context + continuation, max_tokens 1, logprobs 1, echo; the
    continuation's log-probs summed equal transformers' on the same tokens."""
    from transformers import AutoModelForCausalLM

    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode(CONTEXT + CONTINUATION)
    num_context = len(tokenizer.encode(CONTEXT))
    reply = _client(server).completions.create(
        model=MODEL_NAME, prompt=CONTEXT + CONTINUATION, max_tokens=1, echo=True, logprobs=1,
        temperature=0,
    )  # fmt: skip
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1  # the prompt's, then the one generated
    served = sum(lp.token_logprobs[num_context : len(ids)])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    direct = sum(logits[i - 1, ids[i]].item() for i in range(num_context, len(ids)))
    assert math.isclose(served, direct, abs_tol=1e-3)


def test_a_streamed_echo_carries_the_same_log_probs(server) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=CONTEXT, max_tokens=3, echo=True, logprobs=1,
                  temperature=0)  # fmt: skip
    whole = _client(server).completions.create(**kwargs).choices[0]
    text, tokens, logprobs = "", [], []
    for chunk in _client(server).completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])


def test_max_tokens_0_needs_echo(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0, "echo": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"


def test_tokenizer_info_describes_the_servers_tokenizer(server) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    tokenizer = server.engine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["model_max_length"] == server.engine.info.max_model_len == 256
    assert info["vocab_size"] == tokenizer.vocab_size
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": CONTEXT}).json()["tokens"]
    assert ids == tokenizer.encode(CONTEXT)


def test_vllms_prompt_logprobs_field(server) -> None:
    """prompt_logprobs as vLLM names it: by token id per prompt position (the first null),
    the prompt token's own among them, equal to echo's; streamed with the first chunk."""
    body = {"model": MODEL_NAME, "prompt": CONTEXT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    shaped = r.json()["choices"][0]["prompt_logprobs"]
    ids = server.engine.tokenizer.encode(CONTEXT)
    assert len(shaped) == len(ids) and shaped[0] is None
    echo = _client(server).completions.create(
        model=MODEL_NAME, prompt=CONTEXT, max_tokens=0, echo=True, logprobs=2
    ).choices[0].logprobs  # fmt: skip
    for position, token_id, want in zip(shaped[1:], ids[1:], echo.token_logprobs[1:]):
        assert 2 <= len(position) <= 3
        assert position[str(token_id)]["logprob"] == pytest.approx(want, abs=1e-5)
        assert sorted(e["rank"] for e in position.values())[:2] == [1, 2]
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert '"prompt_logprobs":[null,' in chunks[0]
    bad = httpx.post(f"{server.url}/v1/completions", json=body | {"prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
