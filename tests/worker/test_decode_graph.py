"""Decode-step graphs: a replayed step gives exactly the eager step's results, and a model that
computes outside the C kernels is left to run eagerly."""

from __future__ import annotations

import random

import pytest
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.kernels import cpu_library as kernels
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C kernels not built here")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    together: bool,
    params: list[SamplingParams] | None = None,
) -> list:
    """Outputs of ``prompts``, all in one batch or one request at a time; GREEDY unless
    ``params`` gives each prompt its own."""
    outputs: dict[str, object] = {}
    params = params or [GREEDY] * len(prompts)
    batches = [list(zip(prompts, params))] if together else [[pp] for pp in zip(prompts, params)]
    ids = []
    for batch in batches:
        ids += [engine.add_request(p, sp) for p, sp in batch]
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [(outputs[i].token_ids, outputs[i].logprobs) for i in ids]


def _engines(path, **kwargs) -> tuple[LLMEngine, LLMEngine]:
    common = dict(model=str(path), max_model_len=128, kv_cache_memory="8MiB", **kwargs)
    return LLMEngine.from_args(**common), LLMEngine.from_args(**common, enforce_eager=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


@pytest.mark.parametrize(
    "arch", ["gemma3", "llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
)
def test_replayed_decodes_equal_eager_ones(tiny_model_dir, arch) -> None:
    # int8 weights: every op of these decode steps has a C kernel (qwen2's q/k/v biases too,
    # and the mixtures' routers and experts).
    graphed, eager = _engines(tiny_model_dir(arch), quantization="int8")
    prompts = _prompts(4, seed=1)
    for together in (False, True):
        assert _run(graphed, prompts, together) == _run(eager, prompts, together)
    assert graphed.executor.worker.runner.decode_graphs.captured_sizes() == [1, 4]
    assert eager.executor.worker.runner.decode_graphs is None


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "fp8"])
def test_quantized_kv_cache_replays_too(tiny_model_dir, kv_dtype) -> None:
    path = tiny_model_dir("gemma3")
    graphed, eager = _engines(path, quantization="int8", kv_cache_dtype=kv_dtype)
    prompts = _prompts(3, seed=3)
    assert _run(graphed, prompts, together=True) == _run(eager, prompts, together=True)
    assert graphed.executor.worker.runner.decode_graphs.captured_sizes() == [3]


def test_model_computing_outside_the_kernels_runs_eagerly(tiny_model_dir) -> None:
    # A float checkpoint's projections are torch's F.linear: nothing to replay.
    graphed, eager = _engines(tiny_model_dir("gemma3"))
    prompts = _prompts(2, seed=2)
    assert _run(graphed, prompts, together=False) == _run(eager, prompts, together=False)
    graphs = graphed.executor.worker.runner.decode_graphs
    assert graphs.captured_sizes() == [] and not graphs.runs(1)


def test_graphs_of_many_sizes_share_logits_and_scratch(tiny_model_dir) -> None:
    # One request, then 20 ending one after another (decode batches of 20 down to 1, each size
    # its own graph), then one again: the scratch buffer grew after the batch-1 graph was
    # recorded, so that graph must follow it.
    graphed, eager = _engines(tiny_model_dir("llama"), quantization="int8")
    prompts = _prompts(21, seed=4)

    def run(engine: LLMEngine, batch: list[list[int]]) -> list:
        params = [
            SamplingParams(temperature=0.0, max_tokens=4 + i, logprobs=2) for i in range(len(batch))
        ]
        return _run(engine, batch, together=True, params=params)

    for batch in (prompts[:1], prompts[1:], prompts[:1]):
        assert run(graphed, batch) == run(eager, batch)
    graphs = graphed.executor.worker.runner.decode_graphs
    sizes = graphs.captured_sizes()
    assert max(sizes) == 20 and len(sizes) > 8
    # Intermediates live in the shared scratch, not in each graph: the scratch holds about one
    # step's worth (a [20, hidden] activation is 20 x 64 x 4 bytes for this model).
    assert graphs.scratch.buffer.numel() < 20 * 1024 * 4 * 8
