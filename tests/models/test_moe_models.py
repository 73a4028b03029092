"""Mixture-of-experts models through the engine, beyond parity with transformers
(test_model_parity.py): a request's greedy output alone equals its output inside a batch,
int8 / int4 experts at load, and router statistics."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from test_model_parity import GREEDY, check_against_hf, prompts_for

from tokenmill.engine import LLMEngine
from tokenmill.moe import FusedMoE
from tokenmill.sampling_params import SamplingParams

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    return [done[i].outputs[0] for i in ids]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_output_alone_equals_inside_a_batch(tiny_model_dir, arch) -> None:
    engine = LLMEngine.from_args(
        model=str(tiny_model_dir(arch)), max_model_len=128, kv_cache_memory="8MiB"
    )
    prompts = prompts_for(6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = _run(engine, prompts, params)
    for prompt, together in zip(prompts, batched):
        (alone,) = _run(engine, [prompt], params)
        assert alone.token_ids == together.token_ids
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_quantized_experts_stay_close_to_float(tiny_model_dir, arch, quantization) -> None:
    """Experts packed at load, expert by expert, into stacks (gate joined with up); the
    log-probs of the float model's greedy tokens move by at most 0.15 (int8) / 1.0 (int4)."""
    path = tiny_model_dir(arch)
    prompt = prompts_for(1, seed=7, lo=30, hi=31)[0]
    (ref,) = _run(LLMEngine.from_args(model=str(path), max_model_len=128), [prompt], GREEDY)
    check_against_hf(path, prompt, ref)
    engine = LLMEngine.from_args(model=str(path), max_model_len=128, quantization=quantization)
    experts = [m for m in engine.executor.worker.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(set(m.packed) == {"gate_up", "down"} for m in experts)
    assert all(m.gate_up is None for m in experts)
    # The float model's continuation, scored by the quantized one.
    rid = engine.add_request(
        prompt + ref.token_ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    )
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    entries = done[rid].prompt_logprobs[len(prompt) :]
    tol = 0.15 if quantization == "int8" else 1.0
    for entry, lp in zip(entries, ref.logprobs):
        assert entry.sampled.logprob == pytest.approx(lp.sampled.logprob, abs=tol)
    assert_all_blocks_free(engine)


def test_router_statistics_count_every_token_each_layer_runs(tiny_model_dir) -> None:
    """Each token a forward pass computes (the prompt's, then every decoded one but the last)
    runs top_k experts in each sparse layer."""
    path = tiny_model_dir("qwen3_moe")  # layers 0 and 2 dense, 1 sparse (decoder_sparse_step 2)
    engine = LLMEngine.from_args(model=str(path), max_model_len=128, moe_router_stats=True)
    assert engine.stats().expert_tokens == {1: (0,) * 8}
    prompts = prompts_for(3, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    _run(engine, prompts, params)
    counts = engine.stats().expert_tokens
    assert set(counts) == {1}
    assert sum(counts[1]) == 2 * sum(len(p) + 5 - 1 for p in prompts)
    off = LLMEngine.from_args(model=str(path), max_model_len=128)
    assert off.stats().expert_tokens is None
