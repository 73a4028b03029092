"""Decode steps through the CUDA-graph path (worker/cuda_graph.py) on conftest.py's
``triton_device``: on a GPU every padded size replays its captured graph; on the CPU the same
padding, buffers, bucketing and output slicing run, with the forward run eagerly where CUDA
would replay its graph. Greedy tokens and log-probs equal the plain eager engine's at batch
sizes that need padding, with and without verification rows, and padded rows touch no live
block. float32 on CUDA too (its "auto" is bfloat16), so the tolerances below hold there."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import cuda_graph, worker
from tokenmill.worker.cuda_graph import PAD_SLOT, CudaDecodeGraphs, graph_batch_sizes

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)


def test_batch_sizes_and_padding():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert cuda_graph.cuda_graphs_supported(torch.device("cpu")) is False


@pytest.fixture
def padded_sizes(monkeypatch) -> list[tuple[int, int]]:
    """Turns the CUDA-graph path on for CPU workers (on CUDA it is on anyway); records (rows,
    padded size) of each step. On CUDA each step's size must replay a captured graph: a failed
    capture runs eagerly, which every comparison here would pass."""
    monkeypatch.setattr(worker, "cuda_graphs_supported", lambda device: True)
    seen: list[tuple[int, int]] = []
    original = CudaDecodeGraphs.step

    def step(self, ids, *args):
        seen.append((len(ids), self.padded_size(len(ids))))
        if self.device.type == "cuda":
            assert self.padded_size(len(ids)) in self.captured_sizes()
        return original(self, ids, *args)

    monkeypatch.setattr(CudaDecodeGraphs, "step", step)
    return seen


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [outputs[i] for i in ids]


def _assert_same(graphed: list, eager: list, tol: float) -> None:
    for g, e in zip(graphed, eager):
        assert g.token_ids == e.token_ids
        for g_lp, e_lp in zip(g.logprobs, e.logprobs, strict=True):
            pairs = [(g_lp.sampled, e_lp.sampled), *zip(g_lp.top, e_lp.top, strict=True)]
            for a, b in pairs:
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert a.logprob == pytest.approx(b.logprob, abs=tol)


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [
        ("llama", {}),
        ("gemma3", {"kv_cache_dtype": "int8"}),
        (
            "llama",
            {
                "speculative_method": "ngram",
                "num_speculative_tokens": 2,
                "speculative_max_batch": 8,
            },
        ),
    ],  # fmt: skip
)
def test_padded_steps_give_the_eager_tokens(
    tiny_model_dir, triton_device, padded_sizes, arch, kwargs
) -> None:
    common = dict(
        model=str(tiny_model_dir(arch)), device=str(triton_device), dtype="float32",
        max_model_len=128, kv_cache_memory="8MiB",
    )  # fmt: skip
    # fp32. A padded batch runs its matmuls at another size (on CUDA maybe another cuBLAS
    # kernel), whose last bits may differ; an int8 cache's rounding turns those into ~1e-3 of
    # a log-prob.
    tol = 1e-2 if kwargs.get("kv_cache_dtype") == "int8" else 1e-4
    graphed = LLMEngine.from_args(**common, **kwargs)
    runner = graphed.executor.worker.runner
    assert runner.cuda_graphs is not None and runner.decode_graphs is None
    eager = LLMEngine.from_args(**common, **kwargs, enforce_eager=True)
    assert eager.executor.worker.runner.cuda_graphs is None
    # A repeating prompt first: ngram drafts for it, so some steps verify (rows > requests).
    prompts = [[5, 6, 7, 8] * 6, *_prompts(7, seed=3)]
    for n in (3, 5, 7):
        padded_sizes.clear()
        _assert_same(_run(graphed, prompts[:n]), _run(eager, prompts[:n]), tol)
        assert any(rows < size for rows, size in padded_sizes), padded_sizes
        assert {size for _, size in padded_sizes} <= set(
            graph_batch_sizes(runner.cuda_graphs.max_batch)
        )
        if "speculative_method" in kwargs:
            assert any(rows > n for rows, _ in padded_sizes), padded_sizes


def test_padded_rows_write_only_the_pad_slot(tiny_model_dir, triton_device, padded_sizes) -> None:
    """After a 3-request step padded to 4, the cache differs from the eager engine's only in
    block 0's first slot."""
    common = dict(
        model=str(tiny_model_dir("llama")), device=str(triton_device), dtype="float32",
        max_model_len=128, kv_cache_memory="8MiB",
    )  # fmt: skip
    graphed = LLMEngine.from_args(**common)
    eager = LLMEngine.from_args(**common, enforce_eager=True)
    prompts = _prompts(3, seed=5)
    _run(graphed, prompts)
    _run(eager, prompts)
    assert (3, 4) in padded_sizes
    block_size = graphed.executor.worker.runner.block_size
    for (gk, gv), (ek, ev) in zip(
        graphed.executor.worker.runner.kv_caches, eager.executor.worker.runner.kv_caches
    ):
        for g, e in ((gk, ek), (gv, ev)):
            g, e = g.flatten(0, 1), e.flatten(0, 1)  # [slots, heads, head_dim]
            close = torch.isclose(g, e, rtol=0, atol=1e-5).flatten(1).all(dim=1)
            assert (~close).nonzero().flatten().tolist() == [PAD_SLOT]
    assert block_size > PAD_SLOT  # block 0: the pool never hands it out
