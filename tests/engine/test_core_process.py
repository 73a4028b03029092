"""The engine core in a process of its own (EngineArgs.core_process): the same outputs as the
core in the engine's process, stop strings that the core runs past, aborts, a core that fails
or dies, and structured outputs compiled again in the core's process."""

from __future__ import annotations

import os
import re

import pytest
from conftest import assert_all_blocks_free, run_to_end

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.engine.core_process import CoreProcess
from tokenmill.sampling_params import SamplingParams, StructuredOutputs


def engine_args(model_dir, **overrides) -> EngineArgs:
    kwargs = dict(model=str(model_dir), max_model_len=256, kv_cache_memory="8MiB", max_num_seqs=32)
    return EngineArgs(**(kwargs | overrides))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def remote(model):
    engine = LLMEngine(engine_args(model, core_process=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def local(model):
    engine = LLMEngine(engine_args(model))
    yield engine
    engine.shutdown()


def completions(outs) -> list:
    """Each output's completions: text, ids, finish reason and sampled log-probs (rounded: the
    core in its own process may take the requests in over more steps, and a batch of another
    size adds up its floats in another order)."""
    return [
        [
            (
                c.text,
                c.token_ids,
                c.finish_reason,
                [round(p.sampled.logprob, 3) for p in c.logprobs or []],
            )
            for c in out.outputs
        ]
        for out in outs
    ]


def test_outputs_are_the_in_process_cores(local, remote) -> None:
    prompts = ["Hello there", "1 2 3", "abc", "The end"]
    items = [
        (prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=16, temperature=0.9, seed=7, logprobs=2)),
        (prompts[2], SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2)),
        (prompts[3], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=5)),
    ]
    want, got = run_to_end(local, items), run_to_end(remote, items)
    assert completions(got) == completions(want)
    for w, g in zip(want, got):
        assert g.metrics.num_generation_tokens == w.metrics.num_generation_tokens
        assert g.metrics.first_token_time is not None and g.metrics.finished_time is not None
    assert remote.stats().num_running == 0


def test_a_stop_string_ends_the_output_though_the_core_ran_on(local, remote) -> None:
    """The front sees a stop string a step after the core ran the token that completes it, or
    later: the tokens the core ran past it are dropped, and its blocks are freed."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (free,) = run_to_end(local, [("Stop here", params)])
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    want, got = (
        run_to_end(local, [("Stop here", stopped)]),
        run_to_end(remote, [("Stop here", stopped)]),
    )
    assert completions(got) == completions(want)
    assert got[0].outputs[0].finish_reason == "stop"
    assert len(got[0].outputs[0].text) < len(text)


def test_an_abort_frees_the_requests_blocks(remote) -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ids = [remote.add_request(p, params) for p in ("one", "two", "three")]
    for _ in range(1000):  # until the first tokens are out
        if any(out.outputs[0].token_ids for out in remote.step()):
            break
    else:
        pytest.fail("no request got a token")
    out = remote.abort_request(ids[1])
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    done = set()
    while remote.has_unfinished_requests():
        done |= {out.request_id for out in remote.step() if out.finished}
    assert done == {ids[0], ids[2]}
    assert_all_blocks_free(remote)


def fail_from_fourth_step() -> None:
    """(Run in the core's process.) Its scheduler fails to take in a step's output from the
    fourth on."""
    from tokenmill.core.scheduler import Scheduler

    update = Scheduler.update_from_output
    calls = [0]

    def failing(self, sched_out, runner_out):
        calls[0] += 1
        if calls[0] >= 4:
            raise RuntimeError("injected fault")
        return update(self, sched_out, runner_out)

    Scheduler.update_from_output = failing


def exit_at_fourth_step() -> None:
    """(Run in the core's process.) The process dies in its fourth step."""
    from tokenmill.core.scheduler import Scheduler

    schedule = Scheduler.schedule
    calls = [0]

    def dying(self):
        calls[0] += 1
        if calls[0] >= 4:
            os._exit(3)
        return schedule(self)

    Scheduler.schedule = dying


@pytest.mark.parametrize(
    ("setup", "error"),
    [
        ("fail_from_fourth_step", "the engine core failed: RuntimeError: injected fault"),
        ("exit_at_fourth_step", "the engine core's process exited (code 3)"),
    ],
)
def test_a_core_that_fails_or_dies_fails_the_step_and_still_takes_aborts(
    model, setup, error
) -> None:
    args = engine_args(model, core_process=True)
    engine = LLMEngine(args, core=CoreProcess(args, setup=f"{__name__}:{setup}"))
    try:
        request_id = engine.add_request("Hello", SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(RuntimeError) as exc:
            for _ in range(1000):
                engine.step()
        assert str(exc.value) == error
        with pytest.raises(RuntimeError, match="the engine core"):
            engine.step()  # it stays failed
        out = engine.abort_request(request_id)  # what the server does to each stream
        assert out is not None and out.finished
        with pytest.raises(RuntimeError, match="the engine core"):
            engine.add_request("Hello", SamplingParams(max_tokens=5))
    finally:
        engine.shutdown()


def test_a_started_core_says_every_block_is_free(model) -> None:
    """Its stats come with its start: no request yet, all of its KV blocks free."""
    engine = LLMEngine(engine_args(model, core_process=True))
    try:
        assert engine.num_free_blocks == engine.num_total_blocks > 0
        assert engine.stats().num_total_blocks == engine.num_total_blocks
    finally:
        engine.shutdown()


def test_arguments_the_core_cannot_run_fail_the_start_with_its_error(model) -> None:
    too_long = dict(max_model_len=512, kv_cache_memory="64KiB")
    with pytest.raises(ValueError) as in_process:
        LLMEngine(engine_args(model, **too_long))
    with pytest.raises(ValueError) as in_core_process:
        LLMEngine(engine_args(model, core_process=True, **too_long))
    assert str(in_core_process.value) == str(in_process.value)
    assert "raise kv_cache_memory or lower max_model_len" in str(in_process.value)


def test_structured_outputs_are_the_in_process_cores(local, remote) -> None:
    """A compiled format reaches the core's process as its source, compiled again there with
    the model's tokenizer: the same constrained outputs, sampled or greedy."""
    formats = [
        StructuredOutputs(json_object=True),
        StructuredOutputs(regex="[ab]{3}-[0-9]+"),
        StructuredOutputs(choice=["yes", "no", "maybe"]),
    ]
    items = [
        ("Hello", SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=formats[0])),
        (
            "1 2",
            SamplingParams(max_tokens=12, temperature=0.9, seed=5, structured_outputs=formats[1]),
        ),
        (
            "abc",
            SamplingParams(
                max_tokens=8, temperature=0.8, seed=2, n=2, structured_outputs=formats[2]
            ),
        ),
    ]
    want, got = run_to_end(local, items), run_to_end(remote, items)
    assert completions(got) == completions(want)
    assert [c.text for c in got[2].outputs] == [c.text for c in want[2].outputs]
    assert re.fullmatch("[ab]{3}-[0-9]+", got[1].outputs[0].text)
    assert all(c.text in ("yes", "no", "maybe") for c in got[2].outputs)
    assert_all_blocks_free(remote)


def test_a_prefix_cache_reset_is_answered_between_steps(remote) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    remote.add_request("Hello there", params)
    remote.step()
    assert remote.reset_prefix_cache() is False  # a request holds blocks still
    while remote.has_unfinished_requests():
        remote.step()
    assert remote.reset_prefix_cache() is True
