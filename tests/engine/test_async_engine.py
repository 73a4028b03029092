"""AsyncEngine: many streams at once on one event loop, each step's outputs handed over in one
wake of the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from conftest import assert_all_blocks_free, fail_steps_after, random_prompts, run_to_end

from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind="delta")


def tiny_engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_args(
        model=str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory="8MiB",
        num_threads=1,
    )  # fmt: skip


def read_behind(
    async_engine: AsyncEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[RequestOutput], EngineDeadError | None]:
    """A stream read by a busy caller (each read blocks the loop 20 ms, as a server writing
    hundreds of chunks does): its outputs, and the error that ended it (a request failing or
    the engine dying), if one did; the engine is shut down after."""

    async def main() -> tuple[list[RequestOutput], EngineDeadError | None]:
        outs, error = [], None
        try:
            async for out in async_engine.generate(prompt, params):
                outs.append(out)
                time.sleep(0.02)  # busy: the next steps' outputs wait in the engine
        except EngineDeadError as e:  # RequestFailedError is one too
            error = e
        await async_engine.shutdown(timeout=1)
        return outs, error

    return asyncio.run(main())


def test_concurrent_streams_get_their_text_and_a_step_wakes_the_loop_once(tiny_model_dir):
    engine = tiny_engine(tiny_model_dir)
    prompts = random_prompts(12, seed=3)
    final = dataclasses.replace(PARAMS, output_kind="final_only")
    alone = [out.outputs[0].text for out in run_to_end(engine, [(p, final) for p in prompts])]
    steps_with_outputs = 0
    step = engine.step

    def counted_step(unread=()):
        nonlocal steps_with_outputs
        outputs = step(unread)
        steps_with_outputs += bool(outputs)
        return outputs

    engine.step = counted_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)

    async def main() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wakes
            wakes += 1
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        async def text_of(prompt: list[int]) -> str:
            return "".join([o.outputs[0].text async for o in async_engine.generate(prompt, PARAMS)])

        texts = await asyncio.gather(*(text_of(p) for p in prompts))
        woken = wakes  # (shutdown's own wait wakes the loop too)
        await async_engine.shutdown()
        return texts, woken

    texts, wakes = asyncio.run(main())
    assert texts == alone
    # (Fewer steps than tokens may have outputs: a stream's wait while it is behind.)
    assert steps_with_outputs > 1 and wakes == steps_with_outputs
    assert_all_blocks_free(engine)


def test_a_consumer_behind_the_engine_gets_what_queued_up_as_one_delta(tiny_model_dir):
    """While the caller is busy, the steps' delta outputs wait in the engine (none is built
    while the last one is unread); the next read gets them as one: fewer outputs than tokens,
    the same text, token ids and log-probs as the request alone."""
    engine = tiny_engine(tiny_model_dir)
    params = dataclasses.replace(PARAMS, max_tokens=24, logprobs=1)
    prompt = random_prompts(1, seed=4)[0]
    (alone,) = run_to_end(engine, [(prompt, dataclasses.replace(params, output_kind="final_only"))])
    async_engine = AsyncEngine(engine)
    built = []  # every output the engine built and handed over
    async_engine.output_hooks.append(built.append)

    outs, error = read_behind(async_engine, prompt, params)
    want = alone.outputs[0]
    assert error is None
    assert 1 < len(outs) < 24 and outs[-1].finished
    assert len(built) <= len(outs) + 1  # not one a step: they waited while unread
    parts = [out.outputs[0] for out in outs]
    assert "".join(p.text for p in parts) == "".join(p.text_delta for p in parts) == want.text
    assert [t for p in parts for t in p.token_ids_delta] == want.token_ids
    # The same tokens and ranks; the values to float rounding (the second run of the prompt
    # hits its cached blocks, so its matmuls have other shapes).
    got = [lp.sampled for p in parts for lp in p.logprobs]
    assert [(t.token_id, t.rank, t.token) for t in got] == [
        (lp.sampled.token_id, lp.sampled.rank, lp.sampled.token) for lp in want.logprobs
    ]
    assert [t.logprob for t in got] == pytest.approx([lp.sampled.logprob for lp in want.logprobs])
    assert_all_blocks_free(engine)


def test_a_request_failing_after_its_outputs_waited_still_streams_its_tokens(tiny_model_dir):
    """A stream behind the engine, whose delta outputs wait unread, then fails in the output
    processing of its fourth token: it still reads its first three tokens, then the error;
    the engine goes on and frees every block."""
    engine = tiny_engine(tiny_model_dir)
    params = dataclasses.replace(PARAMS, max_tokens=24)
    prompt = random_prompts(1, seed=5)[0]
    (alone,) = run_to_end(engine, [(prompt, dataclasses.replace(params, output_kind="final_only"))])
    append = engine.output_processor._append

    def failing_append(seq, update, params):
        if len(seq.detokenizer.token_ids) >= 3:
            raise RuntimeError("injected fault")
        return append(seq, update, params)

    engine.output_processor._append = failing_append  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)

    outs, error = read_behind(async_engine, prompt, params)
    assert isinstance(error, RequestFailedError) and "injected fault" in str(error)
    first_three = alone.outputs[0].token_ids[:3]
    assert [t for out in outs for t in out.outputs[0].token_ids_delta] == first_three
    assert not any(out.finished for out in outs)
    assert_all_blocks_free(engine)


def test_a_stream_behind_a_dying_engine_reads_its_tokens_then_the_error(tiny_model_dir):
    """The engine's fourth step fails while a stream's delta outputs wait unread: the stream
    reads the three tokens of the steps before, then EngineDeadError."""
    engine = tiny_engine(tiny_model_dir)
    params = dataclasses.replace(PARAMS, max_tokens=24)
    prompt = random_prompts(1, seed=6)[0]
    (alone,) = run_to_end(engine, [(prompt, dataclasses.replace(params, output_kind="final_only"))])
    num_steps = fail_steps_after(engine, 3)
    async_engine = AsyncEngine(engine)

    outs, error = read_behind(async_engine, prompt, params)
    assert error is not None and "boom" in str(error) and async_engine.is_dead
    assert num_steps == [4]  # a dead engine steps no more
    first_three = alone.outputs[0].token_ids[:3]
    assert [t for out in outs for t in out.outputs[0].token_ids_delta] == first_three
