"""Prefix caching through the engine: same outputs with it on and off, hits counted, salts
isolate tenants, and no block leaks."""

from __future__ import annotations

import random

import pytest
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

BLOCK = 8


def make_engine(path, caching: bool) -> LLMEngine:
    return LLMEngine.from_args(
        model=str(path),
        max_model_len=256,
        kv_cache_memory="8MiB",
        block_size=BLOCK,
        enable_prefix_caching=caching,
        max_num_batched_tokens=64,
    )


def run(engine: LLMEngine, prompts, params, salts=None) -> list:
    ids = []
    for i, p in enumerate(prompts):
        ids.append(engine.add_request(p, params, cache_salt=salts[i] if salts else None))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def shared_prefix_prompts(prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, 259) for _ in range(prefix_len - 1)]
    return [prefix + [rng.randrange(3, 259) for _ in range(rng.randrange(1, 12))] for _ in range(6)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    path = tiny_model_dir("llama")
    return make_engine(path, True), make_engine(path, False)


@pytest.mark.parametrize("prefix_len", [2 * BLOCK, 3 * BLOCK + 5, 40])
@pytest.mark.parametrize("seeded", [False, True])
def test_outputs_identical_with_and_without_caching(engines, prefix_len, seeded):
    on, off = engines
    params = (
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
        if seeded
        else SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    prompts = shared_prefix_prompts(prefix_len, seed=prefix_len)
    # Sent one after another so later ones hit the blocks of earlier ones; then as a batch.
    for batch in ([p] for p in prompts):
        a = run(on, batch, params)[0].outputs[0].token_ids
        b = run(off, batch, params)[0].outputs[0].token_ids
        assert a == b
    assert [o.outputs[0].token_ids for o in run(on, prompts, params)] == [
        o.outputs[0].token_ids for o in run(off, prompts, params)
    ]
    assert_all_blocks_free(on)
    assert_all_blocks_free(off)


def test_cached_tokens_reported_and_counted(engines):
    on, _ = engines
    on.reset_prefix_cache()
    prompt = shared_prefix_prompts(4 * BLOCK + 3, seed=99)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = run(on, [prompt], params)[0]
    hits_before = on.scheduler.kv.num_hit_tokens
    second = run(on, [prompt], params)[0]
    assert first.metrics.num_cached_tokens == 0
    # All full blocks but never the whole prompt: the last token must run for logits.
    assert second.metrics.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert on.scheduler.kv.num_hit_tokens - hits_before == second.metrics.num_cached_tokens
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(on)


def test_cache_salt_isolates_requests(engines):
    on, _ = engines
    on.reset_prefix_cache()
    prompt = shared_prefix_prompts(3 * BLOCK, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    run(on, [prompt], params, salts=["tenant-a"])
    other = run(on, [prompt], params, salts=["tenant-b"])[0]
    same = run(on, [prompt], params, salts=["tenant-a"])[0]
    assert other.metrics.num_cached_tokens == 0
    assert same.metrics.num_cached_tokens > 0
    assert_all_blocks_free(on)


def test_n_siblings_share_prompt_blocks(engines):
    on, _ = engines
    on.reset_prefix_cache()
    prompt = shared_prefix_prompts(5 * BLOCK + 2, seed=11)[0]
    out = run(on, [prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6))[0]
    assert len(out.outputs) == 3
    # Siblings after the first found its full prompt blocks in the cache.
    assert out.metrics.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert_all_blocks_free(on)


def test_reset_prefix_cache(engines):
    on, _ = engines
    prompt = shared_prefix_prompts(3 * BLOCK, seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    run(on, [prompt], params)
    assert on.reset_prefix_cache()
    assert run(on, [prompt], params)[0].metrics.num_cached_tokens == 0
    assert_all_blocks_free(on)
