"""Draft-model speculation (worker/draft_proposer.py) through the engine, on tiny random models.

The draft is the target itself (every proposal right), its first layer only (an early-exit
self-draft, often wrong), or another model with the same vocabulary (mostly wrong): greedy
output is the output without speculation in every case, and every block of both caches is free
once the requests finish.
"""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from test_spec_decode import PROMPTS, generate

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def draft_pool(engine: LLMEngine):
    return engine.executor.worker.runner.proposer.pool


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("draft_num_layers", [None, 1])
def test_greedy_output_is_the_output_without_it(tiny_model_dir, arch, draft_num_layers) -> None:
    path = tiny_model_dir(arch)
    plain, plain_deliveries, _ = generate(path, PROMPTS)
    draft = dict(draft_model=str(path), draft_num_layers=draft_num_layers)
    spec, spec_deliveries, engine = generate(path, PROMPTS, speculative_method="draft", **draft)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for ours, ref in zip(spec, plain):
        for got, want in zip(ours.logprobs, ref.logprobs):
            assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=1e-4)
    stats = engine.stats().spec_decode
    assert stats.num_draft_tokens > 0
    if draft_num_layers is None:  # the target drafting for itself is always right
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert spec_deliveries < plain_deliveries
    pool = draft_pool(engine)
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_self_draft_of_the_first_layers_needs_no_draft_model(tiny_model_dir) -> None:
    path = tiny_model_dir("gemma3")
    plain, _, _ = generate(path, PROMPTS[:1])
    spec, _, engine = generate(path, PROMPTS[:1], speculative_method="draft", draft_num_layers=2)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    draft_model = engine.executor.worker.draft.model
    assert len(draft_model.model.layers) == 2


def test_a_different_model_of_the_same_vocabulary_drafts_losslessly(tiny_model_dir) -> None:
    target, other = tiny_model_dir("llama"), tiny_model_dir("qwen3")
    plain, _, _ = generate(target, PROMPTS)
    spec, _, engine = generate(target, PROMPTS, speculative_method="draft", draft_model=str(other))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_with_chunked_prefill_and_preemption(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    prompts = PROMPTS * 3
    plain, _, _ = generate(path, prompts)
    # 18 blocks of the target's 2 layers, each with its twin of the draft's 1 layer.
    block = 16 * 2 * 2 * 2 * 16 * 4 * 3 // 2
    tight = dict(max_num_batched_tokens=24, kv_cache_memory=18 * block)
    spec, _, engine = generate(
        path, prompts, speculative_method="draft", draft_num_layers=1, **tight
    )
    assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    pool = draft_pool(engine)
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_seeded_sampling_is_reproducible_and_stops_at_max_tokens(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True)
    kwargs = dict(speculative_method="draft", draft_num_layers=1)
    first, _, _ = generate(path, PROMPTS, params, **kwargs)
    again, _, _ = generate(path, PROMPTS, params, **kwargs)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 30 for o in first)


def test_a_draft_of_another_vocabulary_is_refused(tiny_model_dir, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenmill.tokenizer.byte_level import write_byte_tokenizer

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path, 300)
    args = EngineArgs(
        model=str(tiny_model_dir("llama")),
        max_model_len=256,
        kv_cache_memory="8MiB",
        speculative_method="draft",
        draft_model=str(tmp_path),
    )
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(args)


def test_bad_draft_settings_are_refused(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="needs draft_model"):
        EngineArgs(speculative_method="draft")
    with pytest.raises(ValueError, match="are for speculative_method='draft'"):
        EngineArgs(speculative_method="ngram", draft_num_layers=2)
    with pytest.raises(ValueError, match="draft_num_layers"):
        LLMEngine(
            EngineArgs(
                model=str(tiny_model_dir("llama")),
                max_model_len=256,
                kv_cache_memory="8MiB",
                speculative_method="draft",
                draft_num_layers=9,
            )
        )


# ---- the sampled distribution ------------------------------------------------------------------

TOP_K = 4  # every row samples one of 4 tokens: 64 outcomes for 3 tokens, few enough to count


def exact_joint(model_dir, prompt: list[int], num_tokens: int) -> dict[tuple[int, ...], float]:
    """P(t1 .. tn) of top-k sampling at temperature 1 under a model (transformers, the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    joint = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for prefix, prob in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
            top = logits.topk(TOP_K)
            for p, t in zip(torch.softmax(top.values, -1).tolist(), top.indices.tolist()):
                grown[prefix + (t,)] = prob * p
        joint = grown
    return joint


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (z = 3.09), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize(
    "draft_arch, draft_num_layers",
    [("qwen3", None), ("llama", 1)],  # other random weights (bad); the target's first layer
)
def test_sampled_tokens_follow_the_target_distribution(
    tiny_model_dir, draft_arch, draft_num_layers
) -> None:
    """2,000 seeded requests sample 3 tokens each (top-k 4, temperature 1) with a draft model;
    the counts of the 64 outcomes fit the target's exact joint distribution (chi-square, cells
    of expected count < 5 merged, P < 0.001 to fail). The draft's own distribution is far from
    the target's (total variation > 0.3), so a verifier that kept drafts unchecked would fail:
    the bad draft is never right (a pure test of the residual draw), the early exit is right
    part of the time (kept drafts and residual draws both)."""
    target, draft = tiny_model_dir("llama"), tiny_model_dir(draft_arch)
    prompt = PROMPTS[1]
    want = exact_joint(target, prompt, 3)
    if draft_num_layers is None:
        drafts_own = exact_joint(draft, prompt, 3)
        assert (
            0.5 * sum(abs(want.get(o, 0) - drafts_own.get(o, 0)) for o in want | drafts_own) > 0.3
        )

    num = 2000
    engine = LLMEngine(
        EngineArgs(
            model=str(target),
            max_model_len=256,
            kv_cache_memory="8MiB",
            max_num_seqs=32,
            speculative_method="draft",
            draft_model=str(draft),
            draft_num_layers=draft_num_layers,
            speculative_max_batch=32,
        )
    )
    for i in range(num):
        params = SamplingParams(temperature=1.0, top_k=TOP_K, seed=i, max_tokens=3, ignore_eos=True)
        engine.add_request(prompt, params)
    counts: dict[tuple[int, ...], int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outcome = tuple(out.outputs[0].token_ids)
                counts[outcome] = counts.get(outcome, 0) + 1
    assert_all_blocks_free(engine)
    stats = engine.stats().spec_decode
    assert stats.num_draft_tokens >= num  # a draft for every request's second token
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    if draft_num_layers is not None:
        assert stats.num_accepted_tokens > 0.1 * stats.num_draft_tokens
    assert set(counts) <= set(want)
    big = [o for o in want if want[o] * num >= 5]
    cells = [(counts.get(o, 0), want[o] * num) for o in big]
    rest = (num - sum(c for c, _ in cells), num * (1 - sum(want[o] for o in big)))
    if rest[1] > 0:
        cells.append(rest)
    chi2 = sum((c - e) ** 2 / e for c, e in cells)
    assert chi2 < chi2_critical(len(cells) - 1), (chi2, len(cells))
