"""Speculative decoding with n-gram proposals through the engine, on tiny random models.

Greedy output must be exactly the output without speculation, for every architecture, in a
batch with chunked prefill and with preemptions forced by a tight KV cache; stop tokens and
max_tokens hold (never more tokens than asked), logprobs come one per token, and every KV
block is free at the end. Prompts repeat a pattern so that proposals exist and some are kept.
"""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)
PROMPTS = [
    [1] + [10, 11, 12, 13, 14] * 6,
    [1, *range(40, 60), *range(40, 60)],
    [1, *range(5, 30)],
]


def generate(path, prompts, params=GREEDY, **kwargs) -> tuple[list, int, LLMEngine]:
    """The finished outputs, how many (request, step) pairs delivered tokens, and the engine."""
    args = dict(model=str(path), max_model_len=256, kv_cache_memory="8MiB") | kwargs
    engine = LLMEngine(EngineArgs(**args))
    ids = [engine.add_request(p, params) for p in prompts]
    done, num_deliveries = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_deliveries += 1
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [done[i] for i in ids], num_deliveries, engine


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_ngram_greedy_output_is_the_output_without_it(tiny_model_dir, arch) -> None:
    path = tiny_model_dir(arch)
    plain, plain_deliveries, _ = generate(path, PROMPTS)
    spec, spec_deliveries, _ = generate(path, PROMPTS, speculative_method="ngram")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_deliveries < plain_deliveries  # some steps gave a request kept drafts
    for ours, ref in zip(spec, plain):
        assert len(ours.logprobs) == len(ours.token_ids)
        for got, want in zip(ours.logprobs, ref.logprobs):
            assert got.sampled.token_id == want.sampled.token_id
            assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=1e-4)


def test_ngram_with_chunked_prefill_and_preemption(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    prompts = PROMPTS * 3
    plain, _, _ = generate(path, prompts)
    tight = dict(max_num_batched_tokens=24, kv_cache_memory=28 * 16 * 2 * 2 * 2 * 16 * 4)
    spec, _, engine = generate(path, prompts, speculative_method="ngram", **tight)
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_ngram_respects_stop_tokens_and_max_tokens(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    (plain,), _, _ = generate(path, PROMPTS[:1])
    stop = plain.token_ids[7]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], logprobs=0),
    ):
        (ref,), _, _ = generate(path, PROMPTS[:1], params)
        (out,), _, _ = generate(
            path, PROMPTS[:1], params, speculative_method="ngram", num_speculative_tokens=8
        )
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(out.token_ids)
        assert out.finish_reason == ref.finish_reason


def test_bad_speculative_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="speculative_method must be one of ngram"):
        EngineArgs(speculative_method="draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineArgs(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=2)
