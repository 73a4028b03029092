"""Prompt log-probs (SamplingParams.prompt_logprobs) through the engine on tiny random models.

Every entry is checked against transformers' log-softmax of the logits at the position before
it (fp32, 1e-4 absolute): whole prompts, prompts split by chunked prefill inside a batch (one
chunk a single token), preempted and recomputed requests, n > 1, and prefix caching (which
such requests must not use). Plus the row slicing on hand-made logits, and bad values.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import run_to_end

from tokenmill.engine import LLMEngine
from tokenmill.models.loader import load_model_config
from tokenmill.outputs import PositionLogprobs
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import sampler as sampler_mod
from tokenmill.worker.model_runner import kv_bytes_per_block
from tokenmill.worker.sampler import compute_prompt_logprobs

ATOL = 1e-4
_HF: dict[str, object] = {}


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is transformers' log-softmax predicting prompt[i + 1]."""
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF:
        _HF[key] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    with torch.no_grad():
        logits = _HF[key](torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check_against_hf(path, prompt: list[int], entries: list[PositionLogprobs | None], k: int):
    ref = hf_prompt_logprobs(path, prompt)
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for pos in range(1, len(prompt)):
        entry, row, tok = entries[pos], ref[pos - 1], prompt[pos]
        assert entry is not None
        assert entry.sampled.token_id == tok
        assert entry.sampled.logprob == pytest.approx(row[tok].item(), abs=ATOL)
        # Rank 1 = most likely; count only the clearly larger values (float noise at ties).
        assert (row > row[tok] + ATOL).sum().item() < entry.sampled.rank
        assert entry.sampled.rank <= (row > row[tok] - ATOL).sum().item() + 1
        assert len(entry.top) == k
        ref_top = row.topk(k).values.tolist() if k else []
        for rank, (alt, ref_value) in enumerate(zip(entry.top, ref_top), start=1):
            assert alt.rank == rank
            assert alt.logprob == pytest.approx(ref_value, abs=ATOL)
            assert alt.logprob == pytest.approx(row[alt.token_id].item(), abs=ATOL)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 259) for _ in range(length - 1)]


def make_engine(path, **overrides) -> LLMEngine:
    args = dict(model=str(path), max_model_len=128, kv_cache_memory="8MiB", num_threads=1)
    return LLMEngine.from_args(**(args | overrides))


def params(prompt_logprobs: int | None, max_tokens: int = 4, **changes) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        prompt_logprobs=prompt_logprobs,
        **changes,
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_whole_prompt_matches_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    prompt = random_prompt(40, seed=1)  # longer than gemma3's 24-token sliding window
    (out,) = run_to_end(make_engine(path), [(prompt, params(3, logprobs=2))])
    check_against_hf(path, prompt, out.prompt_logprobs, k=3)
    # The sampled tokens' logprobs are untouched: greedy, so the pick is rank 1.
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 4
    assert all(lp.sampled.rank == 1 for lp in completion.logprobs)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_inside_a_batch(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    engine = make_engine(path, max_num_batched_tokens=16)
    # The first prompt takes 15 of the 16-token budget, so the second's first chunk is a single
    # token (laid out like a decode); then it comes in 16-token chunks.
    short, long_a, long_b, other = (random_prompt(n, seed=n) for n in (15, 50, 33, 20))
    items = [(short, params(None)), (long_a, params(2)), (long_b, params(0)), (other, params(None))]
    outs = run_to_end(engine, items)
    check_against_hf(path, long_a, outs[1].prompt_logprobs, k=2)
    check_against_hf(path, long_b, outs[2].prompt_logprobs, k=0)
    assert outs[0].prompt_logprobs is None and outs[3].prompt_logprobs is None
    # Asking for prompt log-probs changes no output: the same prompts without them.
    plain = run_to_end(engine, [(p, params(None)) for p, _ in items])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_preempted_requests_send_each_position_once(tiny_model_dir):
    path = tiny_model_dir("llama")
    config = load_model_config(resolve_model(str(path)))
    block_size = 8
    per_block = kv_bytes_per_block(config, block_size, torch.float32)
    # 16 usable blocks = 128 tokens for 6 requests of up to ~75 tokens each: forces preemption.
    engine = make_engine(
        path,
        max_model_len=96,
        block_size=block_size,
        kv_cache_memory=per_block * 17,
        max_num_batched_tokens=20,
        enable_prefix_caching=False,
    )
    preempted_mid_prompt: list[bool] = []
    preempt = engine.scheduler._preempt

    def spy(req) -> None:
        preempted_mid_prompt.append(req.num_computed_tokens < req.num_prompt_tokens)
        preempt(req)

    engine.scheduler._preempt = spy
    # The worker itself sends no position twice (recompute after preemption skips them).
    sent: dict[str, list[int]] = {}
    execute = engine.executor.worker.runner.execute

    def record(sched):
        out = execute(sched)
        for rid, lps in out.prompt_logprobs.items():
            sent.setdefault(rid, []).extend(range(lps.first_pos, lps.first_pos + len(lps.sampled)))
        return out

    engine.executor.worker.runner.execute = record
    rng = random.Random(2)
    prompts = [random_prompt(rng.randrange(20, 58), seed=100 + i) for i in range(6)]
    outs = run_to_end(engine, [(p, params(1, max_tokens=16)) for p in prompts])
    assert any(preempted_mid_prompt) and not all(preempted_mid_prompt)
    for prompt, out in zip(prompts, outs):
        assert sent[out.request_id] == list(range(1, len(prompt)))
        check_against_hf(path, prompt, out.prompt_logprobs, k=1)


def test_prefix_cache_hits_are_skipped_for_prompt_logprobs(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path, block_size=8, enable_prefix_caching=True)
    prompt = random_prompt(40, seed=3)
    (first,) = run_to_end(engine, [(prompt, params(0))])
    (second,) = run_to_end(engine, [(prompt, params(0))])
    (plain,) = run_to_end(engine, [(prompt, params(None))])
    assert plain.metrics.num_cached_tokens == 32  # the cache holds the prompt's 4 full blocks
    assert second.metrics.num_cached_tokens == 0  # yet the repeat computed its whole prompt
    check_against_hf(path, prompt, second.prompt_logprobs, k=0)
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert b.sampled.logprob == pytest.approx(a.sampled.logprob, abs=ATOL)


def test_n_siblings_share_one_prompt_list(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = random_prompt(30, seed=4)
    engine = make_engine(path, max_num_batched_tokens=16)
    sampled = SamplingParams(n=3, seed=5, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    (out,) = run_to_end(engine, [(prompt, sampled)])
    assert len(out.outputs) == 3
    check_against_hf(path, prompt, out.prompt_logprobs, k=1)


def test_off_by_default_and_one_token_prompt(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    off, one = run_to_end(engine, [(random_prompt(10, seed=6), params(None)), ([1], params(5))])
    assert off.prompt_logprobs is None
    assert one.prompt_logprobs == [None]


def test_row_slices_give_the_same_values(monkeypatch):
    # 300 rows in slices of 128 (the last one partial) against log-softmax of all rows at once.
    torch.manual_seed(0)
    hidden = torch.randn(300, 16)
    head = torch.randn(50, 16)
    targets = torch.randint(0, 50, (300,)).tolist()
    calls: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head.T

    monkeypatch.setattr(sampler_mod, "PROMPT_LOGPROBS_ROWS", 128)
    out = compute_prompt_logprobs(hidden, compute_logits, targets, k=3, first_pos=7)
    assert calls == [128, 128, 44]
    ref = torch.log_softmax(hidden @ head.T, dim=-1)
    assert out.first_pos == 7 and len(out.sampled) == len(out.top) == 300
    for i, (entry, top) in enumerate(zip(out.sampled, out.top)):
        assert entry.token_id == targets[i]
        assert entry.logprob == pytest.approx(ref[i, targets[i]].item(), abs=1e-5)
        assert entry.rank == (ref[i] > ref[i, targets[i]]).sum().item() + 1
        values, ids = ref[i].topk(3)
        assert [t.token_id for t in top] == ids.tolist()
        assert [t.logprob for t in top] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "2"])
def test_bad_values_raise_naming_the_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
