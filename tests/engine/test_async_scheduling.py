"""Async scheduling (engine/llm_engine.py, worker/model_runner.py's launch / collect) on the
tiny random Llama: the engine schedules and launches step N+1 before it takes in step N's
tokens, and gives every request the same tokens as steps run one at a time, through each input
path (eager steps, CPU decode graphs, the CUDA-graph path run eagerly on the CPU), with stops,
seeds, preemption, aborts and requests that need their tokens on the host (which run whole).
Every run ends with all KV blocks free. float32 on CUDA too (its "auto" is bfloat16): the
two orders may batch a step's rows differently, which bf16 rounds differently."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free, random_prompts, run_to_end

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import worker
from tokenmill.worker.model_runner import ModelRunner, kv_bytes_per_block

MAX_MODEL_LEN = 128


def make_engine(tiny_model_dir, async_scheduling: bool, **kwargs) -> LLMEngine:
    args = dict(
        model=str(tiny_model_dir("llama")),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=64,
        num_threads=1,
        dtype="float32",
        async_scheduling=async_scheduling,
    )
    return LLMEngine.from_args(**(args | kwargs))


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Counts the steps launched ahead (rows of each), so a test sees the overlap happen."""
    seen: list[int] = []
    original = ModelRunner.launch

    def launch(self, sched):
        seen.append(len(sched.num_scheduled_tokens))
        return original(self, sched)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    return seen


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded requests with every kind of stop the scheduler and output side know."""
    kinds = [
        dict(temperature=0.0, max_tokens=12, ignore_eos=True),
        dict(temperature=1.0, seed=11, max_tokens=9, ignore_eos=True),
        dict(temperature=0.8, top_p=0.9, seed=5, max_tokens=14),  # may stop on EOS
        dict(temperature=0.0, max_tokens=20, stop_token_ids=[100, 101, 102, 103, 104]),
        dict(temperature=1.0, seed=3, max_tokens=16, min_tokens=4, ignore_eos=True),
        dict(temperature=0.0, max_tokens=1),
        dict(temperature=1.0, seed=9, max_tokens=20, stop=["a", "e"], ignore_eos=True),
    ]
    return [SamplingParams(**kinds[i % len(kinds)]) for i in range(n)]


def tokens(outputs: list) -> list[tuple[list[int], str, str]]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs
    ]


@pytest.mark.parametrize("path", ["eager", "cpu_graphs", "cuda_graphs"])
def test_async_steps_give_the_tokens_of_steps_one_at_a_time(
    tiny_model_dir, monkeypatch, launches, path
):
    kwargs = {"enforce_eager": True} if path == "eager" else {}
    if path == "cuda_graphs":  # the CUDA-graph path's buffers and padding, run eagerly on CPU
        monkeypatch.setattr(worker, "cuda_graphs_supported", lambda device: True)
    items = list(zip(random_prompts(14, seed=0), mixed_params(14)))
    ref = tokens(run_to_end(make_engine(tiny_model_dir, False, **kwargs), items))
    assert not launches
    engine = make_engine(tiny_model_dir, True, **kwargs)
    assert engine.core.async_scheduling
    assert tokens(run_to_end(engine, items)) == ref
    assert max(launches) > 1 and len(launches) > 20
    # A lone request runs ahead every step, its decodes each with the pick of the step before.
    launches.clear()
    (alone,) = run_to_end(engine, items[:1])
    assert alone.outputs[0].token_ids == ref[0][0]
    assert launches == [1] * 12


def test_requests_that_need_their_tokens_on_the_host_run_whole_beside_async_ones(
    tiny_model_dir, launches
):
    host_side = [
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=8, presence_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, ignore_eos=True),
    ]
    items = list(zip(random_prompts(9, seed=1), mixed_params(6) + host_side))
    ref = run_to_end(make_engine(tiny_model_dir, False), items)
    engine = make_engine(tiny_model_dir, True)
    outs = run_to_end(engine, items)
    assert tokens(outs) == tokens(ref)
    for out, r in zip(outs[6:], ref[6:]):
        assert out.outputs[0].logprobs == r.outputs[0].logprobs
        assert out.prompt_logprobs == r.prompt_logprobs
    assert launches  # the steps after the host-side requests left ran ahead again


@pytest.mark.parametrize("tp", [1, 2])
def test_preemption_and_chunking_under_async_scheduling(tiny_model_dir, launches, tp):
    """With tp 2, every rank drops a preempted request's launched picks alike."""
    items = list(zip(random_prompts(6, seed=5), [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True)
        for i in range(6)
    ]))  # fmt: skip
    plain = make_engine(tiny_model_dir, False)
    ref = run_to_end(plain, items)
    config = plain.config.model_config
    # 16 usable blocks of 8 = 128 tokens for 6 requests of up to ~56 tokens: forces preemption
    # (a rank holds 1/tp of the KV heads, so 1/tp of the memory holds as many blocks).
    tight = make_engine(
        tiny_model_dir,
        True,
        block_size=8,
        kv_cache_memory=kv_bytes_per_block(config, 8, torch.float32) * 17 // tp,
        max_num_batched_tokens=20,
        tensor_parallel_size=tp,
    )
    try:
        outs = run_to_end(tight, items)
        assert tight.scheduler.num_preemptions > 0
        assert launches
        assert tokens(outs) == tokens(ref)
        assert_all_blocks_free(tight)
    finally:
        tight.shutdown()


def test_abort_while_a_step_is_launched(tiny_model_dir, launches):
    engine = make_engine(tiny_model_dir, True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ps = random_prompts(3, seed=2)
    (ref,) = run_to_end(make_engine(tiny_model_dir, False), [(ps[1], params)])
    ids = [engine.add_request(p, params) for p in ps]
    for _ in range(5):
        engine.step()
    assert engine.core._launched is not None  # a step is on its way
    aborted = engine.abort_request(ids[0])
    assert aborted is not None and aborted.finished
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != ids[0]
            if out.finished:
                done[out.request_id] = out
    assert set(done) == set(ids[1:])
    assert done[ids[1]].outputs[0].token_ids == ref.outputs[0].token_ids
    assert_all_blocks_free(engine)
    assert engine.core._launched is None


def test_tensor_parallel_ranks_launch_and_collect_in_step(tiny_model_dir, launches):
    """TP=2 over the multiprocess executor (gloo on the CPU): every rank queues each step and
    the engine schedules the next one meanwhile; the same tokens as one worker stepping one
    at a time, host-side requests (run whole) among them."""
    host_side = [
        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=8, presence_penalty=1.5),
    ]
    items = list(zip(random_prompts(10, seed=2), mixed_params(8) + host_side))
    ref = tokens(run_to_end(make_engine(tiny_model_dir, False), items))
    engine = make_engine(tiny_model_dir, True, tensor_parallel_size=2)
    try:
        assert engine.core.async_scheduling
        assert tokens(run_to_end(engine, items)) == ref
        assert max(launches) > 1 and len(launches) > 10
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_async_scheduling_refuses_what_it_cannot_run_with(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative"):
        make_engine(tiny_model_dir, True, speculative_method="ngram")
    # Unset, it is on with CUDA and off on a CPU (nothing runs beside the engine's thread).
    engine = make_engine(tiny_model_dir, None)
    assert engine.core.async_scheduling == engine.config.device.startswith("cuda")
