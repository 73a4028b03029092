"""The CUDA model path end to end (issue 24) on conftest.py's ``triton_device``: the Triton
kernel and attention backends with decode steps through the CUDA-graph runner's padded
persistent buffers. On a GPU the kernels are compiled and the graphs captured and replayed;
without one the kernels run in Triton's interpreter and the steps run eagerly over the same
buffers. Greedy tokens and log-probs equal the pure-torch eager engine's (on the same device)
on tiny models of several architectures, and every KV block is free at the end; bfloat16,
CUDA's default dtype, runs too."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import worker
from tokenmill.worker.cuda_graph import CudaDecodeGraphs

pytest.importorskip("triton")

# gemma4_ple: Gemma 4's repeated-head window caches, KV sharing and per-layer embeddings.
ARCHS = ["llama", "gemma3", "qwen3", "phi3", "olmo2", "smollm3", "gemma2", "gpt_oss", "gemma4_ple"]
PROMPTS = ["hello world", "the quick brown fox", "a", "numbers 1 2 3 4 5 6 7 8 9"]


def _run(model: str, device: torch.device, **args: object) -> list[tuple[list[int], list[float]]]:
    engine = LLMEngine.from_args(
        model=model, device=str(device), kv_cache_memory="8MiB", max_model_len=256,
        max_num_seqs=8, **args,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=str(i))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [
        (finals[str(i)].token_ids, [lp.sampled.logprob for lp in finals[str(i)].logprobs])
        for i in range(len(PROMPTS))
    ]


@pytest.fixture
def cuda_graph_path(monkeypatch) -> list[int]:
    """The CUDA-graph runner on for CPU workers (on CUDA it is on anyway); the rows of each
    step it ran. On CUDA each step's size must replay a captured graph: a failed capture runs
    eagerly, which the comparisons would pass."""
    monkeypatch.setattr(worker, "cuda_graphs_supported", lambda device: True)
    rows: list[int] = []
    original = CudaDecodeGraphs.step

    def step(self, ids, *args):
        rows.append(len(ids))
        if self.device.type == "cuda":
            assert self.padded_size(len(ids)) in self.captured_sizes()
        return original(self, ids, *args)

    monkeypatch.setattr(CudaDecodeGraphs, "step", step)
    return rows


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_path_with_graph_buffers_equals_torch_eager(
    tiny_model_dir, triton_device, cuda_graph_path, arch: str
) -> None:
    # float32 on CUDA too (its "auto" is bfloat16): the kernels' float32 dot products are IEEE
    # and torch's float32 matmuls on CUDA use no TF32 by default, so 1e-4 holds there.
    model = str(tiny_model_dir(arch))
    want = _run(model, triton_device, dtype="float32", kernel_backend="torch", enforce_eager=True)
    assert not cuda_graph_path
    got = _run(model, triton_device, dtype="float32", kernel_backend="triton")
    assert len(PROMPTS) in cuda_graph_path  # every decode step went through its buffers
    for (want_ids, want_lps), (got_ids, got_lps) in zip(want, got, strict=True):
        assert got_ids == want_ids
        assert got_lps == pytest.approx(want_lps, abs=1e-4)


def test_bfloat16_triton_path_agrees_with_bfloat16_torch(
    tiny_model_dir, triton_device, cuda_graph_path
) -> None:
    """In bfloat16 the two paths round differently (the interpreter truncates stores; on a GPU
    the kernels and torch's bf16 matmuls and SDPA round and sum in other orders), so a
    near-tie may flip: most greedy tokens agree and log-probs stay close."""
    model = str(tiny_model_dir("llama"))
    want = _run(model, triton_device, dtype="bfloat16", kernel_backend="torch", enforce_eager=True)
    got = _run(model, triton_device, dtype="bfloat16", kernel_backend="triton")
    same = sum(a == b for (w, _), (g, _) in zip(want, got) for a, b in zip(w, g))
    assert same >= 0.8 * sum(len(w) for w, _ in want)
    first = [(w[0], g[0]) for (_, w), (_, g) in zip(want, got)]
    assert all(abs(a - b) < 0.1 for a, b in first)


def test_hybrid_linear_attention_runs_the_triton_path_eagerly(
    tiny_model_dir, triton_device, cuda_graph_path
) -> None:
    """Qwen3-Next's Gated DeltaNet layers keep per-request state no graph records yet: its
    steps run eagerly on the Triton kernels (attention and matmuls) and equal torch's."""
    model = str(tiny_model_dir("qwen3_next"))
    want = _run(model, triton_device, dtype="float32", kernel_backend="torch", enforce_eager=True)
    got = _run(model, triton_device, dtype="float32", kernel_backend="triton")
    assert not cuda_graph_path  # eager: the graph runner never ran a step
    for (want_ids, want_lps), (got_ids, got_lps) in zip(want, got, strict=True):
        assert got_ids == want_ids
        assert got_lps == pytest.approx(want_lps, abs=1e-4)
