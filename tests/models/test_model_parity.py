"""Each architecture's tiny random model (the mixtures of experts too) matches transformers,
through the whole engine.

Logprobs (log-softmax of the logits) are compared at every generated position: the first comes
from a prefill, the rest from decode steps. Tolerance: 1e-4 absolute, fp32.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_all_blocks_free, run_to_end

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import kv_bytes_per_block

ARCHS = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "smollm3",
    "phi3",
    "olmo2",
    "gemma2",
    "gemma3",
    "gemma4",
    "gemma4_ple",
    "gemma4_moe",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
]
ATOL = 1e-4
_HF: dict[str, object] = {}


def hf_model(path):
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF:
        _HF[key] = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _HF[key]


def hf_logprobs(path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log-probs transformers assigns at each output position."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(path)(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], dim=-1)


def check_against_hf(path, prompt, completion) -> None:
    ref = hf_logprobs(path, prompt, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    for pos, (tok, lp) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert lp.sampled.token_id == tok
        assert lp.sampled.logprob == pytest.approx(ref[pos, tok].item(), abs=ATOL)
        # Greedy: the pick is transformers' argmax (up to float ties).
        assert ref[pos, tok].item() >= ref[pos].max().item() - ATOL
        for alt in lp.top:
            assert alt.logprob == pytest.approx(ref[pos, alt.token_id].item(), abs=ATOL)


def prompts_for(n: int, seed: int, lo: int = 8, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    engine = LLMEngine.from_args(model=str(path), max_model_len=256, kv_cache_memory="8MiB")
    prompt = prompts_for(1, seed=1, lo=40, hi=41)[0]  # longer than the 24-token windows
    rid = engine.add_request(prompt, GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    completion = outputs[rid].outputs[0]
    assert len(completion.token_ids) == 16
    check_against_hf(path, prompt, completion)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_with_chunked_prefill_and_preemption(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    from tokenmill.models.loader import load_model_config
    from tokenmill.resolve import resolve_model

    config = load_model_config(resolve_model(str(path)))
    block_size = 8
    per_block = kv_bytes_per_block(config, block_size, torch.float32)
    # 16 usable blocks = 128 tokens for 6 requests of up to ~75 tokens each: forces preemption.
    engine = LLMEngine.from_args(
        model=str(path),
        max_model_len=96,
        block_size=block_size,
        kv_cache_memory=per_block * 17,
        max_num_batched_tokens=20,  # long prompts are chunked
        enable_prefix_caching=False,
    )
    prompts = prompts_for(6, seed=2, lo=20, hi=58)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in zip(ids, prompts):
        check_against_hf(path, prompt, done[rid].outputs[0])
    assert_all_blocks_free(engine)


def test_a_windowed_model_holds_only_its_window_and_still_matches(tiny_model_dir):
    """Mistral windows every layer (24 tokens here), so blocks before a request's window are
    released as it runs; a long generation still matches transformers, and a second request
    with the same prompt still finds it cached while the first runs."""
    path = tiny_model_dir("mistral")
    block_size = 8
    engine = LLMEngine.from_args(
        model=str(path), max_model_len=256, block_size=block_size, kv_cache_memory="8MiB",
        max_num_batched_tokens=16,  # the prompt runs in chunks, each on released blocks
    )  # fmt: skip
    assert engine.config.cache_config.group_windows == (24,)
    prompt = prompts_for(1, seed=3, lo=40, hi=41)[0]
    longer = SamplingParams(temperature=0.0, max_tokens=80, logprobs=5, ignore_eos=True)
    first = engine.add_request(prompt, longer)
    held, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        if len(held) == 60:
            second = engine.add_request(prompt, GREEDY)
        (table,) = engine.scheduler.kv.block_ids(first)
        held.append(sum(1 for b in table if b != 0))
    # A window of 24 plus a step of up to 16 spans at most 6 blocks of 8; the context, 15.
    assert max(held) <= 6 < -(-(len(prompt) + 80) // block_size)
    check_against_hf(path, prompt, outputs[first].outputs[0])
    check_against_hf(path, prompt, outputs[second].outputs[0])
    assert outputs[second].metrics.num_cached_tokens > 0
    assert_all_blocks_free(engine)


def test_a_hybrid_model_keeps_only_its_window_layers_windows_and_still_matches(tiny_model_dir):
    """The tiny Gemma 3 has 5 local layers (window 24) and 1 global one: a block table per
    layer (kv_layout.py). The global layer's table keeps every block; the local layers' keep
    only their window's, as the request runs. A long generation still matches transformers,
    and a second request with the same prompt still finds it cached while the first runs."""
    path = tiny_model_dir("gemma3")
    block_size = 8
    engine = LLMEngine.from_args(
        model=str(path), max_model_len=256, block_size=block_size, kv_cache_memory="8MiB",
        max_num_batched_tokens=16,  # the prompt runs in chunks, each on released blocks
    )  # fmt: skip
    assert engine.config.cache_config.group_windows == (None,) + (24,) * 5
    prompt = prompts_for(1, seed=3, lo=40, hi=41)[0]
    longer = SamplingParams(temperature=0.0, max_tokens=80, logprobs=5, ignore_eos=True)
    first = engine.add_request(prompt, longer)
    held, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        if len(held) == 60:
            second = engine.add_request(prompt, GREEDY)
        tables = engine.scheduler.kv.block_ids(first)
        held.append([sum(1 for b in t if b != 0) for t in tables])
    whole = -(-(len(prompt) + 79) // block_size)  # the last sample never runs
    assert max(h[0] for h in held) == whole  # the global layer: every token's block
    # A window of 24 plus a step of up to 16 spans at most 6 blocks of 8.
    assert max(n for h in held for n in h[1:]) <= 6 < whole
    check_against_hf(path, prompt, outputs[first].outputs[0])
    check_against_hf(path, prompt, outputs[second].outputs[0])
    assert outputs[second].metrics.num_cached_tokens > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    "arch",
    ["smollm3", "phi3", "olmo2", "gemma2", "gpt_oss", "qwen3_next", "gemma4_ple", "gemma4_moe"],
)
def test_bfloat16_runs_and_stays_near_float32(tiny_model_dir, arch):
    """In bfloat16 (CUDA's default dtype) every layer of the newer families takes its
    activations' dtype (gpt-oss's experts, sinks and biases included): the first token's
    log-prob stays near float32's."""
    path = str(tiny_model_dir(arch))
    prompt = prompts_for(1, seed=4, lo=30, hi=31)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    first = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine.from_args(model=path, max_model_len=128, kv_cache_memory="4MiB",
                                     dtype=dtype, kernel_backend="torch")  # fmt: skip
        (out,) = [o for o in run_to_end(engine, [(prompt, params)])]
        assert len(out.outputs[0].token_ids) == 4
        first[dtype] = out.outputs[0].logprobs[0].sampled
        assert_all_blocks_free(engine)
    if first["float32"].token_id == first["bfloat16"].token_id:
        assert abs(first["float32"].logprob - first["bfloat16"].logprob) < 0.1
