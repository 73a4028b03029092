"""AsyncEngine: many streams at once on one event loop, each step's outputs handed over in one
wake of the loop."""

from __future__ import annotations

import asyncio
import dataclasses

from conftest import assert_all_blocks_free, random_prompts, run_to_end

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, output_kind="delta")


def test_concurrent_streams_get_their_text_and_a_step_wakes_the_loop_once(tiny_model_dir):
    engine = LLMEngine.from_args(
        model=str(tiny_model_dir("llama")), max_model_len=128, kv_cache_memory="8MiB",
        num_threads=1,
    )  # fmt: skip
    prompts = random_prompts(12, seed=3)
    final = dataclasses.replace(PARAMS, output_kind="final_only")
    alone = [out.outputs[0].text for out in run_to_end(engine, [(p, final) for p in prompts])]
    steps_with_outputs = 0
    step = engine.step

    def counted_step():
        nonlocal steps_with_outputs
        outputs = step()
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
    assert steps_with_outputs >= 8 and wakes == steps_with_outputs
    assert_all_blocks_free(engine)
