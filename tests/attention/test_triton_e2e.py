"""A tiny model generates the same greedy tokens, with log-probabilities within 1e-4 (float32,
12 steps; the two backends round differently: SDPA against an online softmax), when its
attention runs in the Triton kernels as when it runs in torch, both engines on conftest.py's
``triton_device`` (compiled on a GPU, interpreted on the CPU without one). Gemma 3's sliding
window (24) is crossed by the longer prompts; the int8 case quantizes K/V in the kernels
(1e-3: an upstream rounding difference can flip an 8-bit code; on CUDA torch's quantize_kv
divides by qmax as a multiply by its reciprocal, one more such difference).

float32 on CUDA too (its "auto" dtype is bfloat16): the kernels' float32 dot products are IEEE
and torch's float32 matmuls on CUDA use no TF32 by default, so 1e-4 holds there."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_all_blocks_free

pytest.importorskip("triton")

from tokenmill.attention import Attention  # noqa: E402
from tokenmill.attention.backends.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
LOGPROB_ATOL = {"auto": 1e-4, "int8": 1e-3}


def _engine(path, device: torch.device, kv_cache_dtype: str, triton: bool) -> LLMEngine:
    """An engine on the torch kernels; with ``triton``, its attention rebound to the Triton
    backend (the loader binds kernels and attention by one name, and the Triton kernel backend
    is another piece of issue 24)."""
    engine = LLMEngine.from_args(
        model=str(path),
        device=str(device),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory="8MiB",
        kernel_backend="torch",
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=True,
    )
    if triton:
        model = engine.executor.worker.runner.model
        model.bind_kernels(model.kernels, TritonAttentionBackend())
        backends = {type(m.backend) for m in model.modules() if isinstance(m, Attention)}
        assert backends == {TritonAttentionBackend}
    return engine


def _generate(engine: LLMEngine) -> list:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (5, 21, 38)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [done[i] for i in ids]


@pytest.mark.parametrize(
    "arch, kv_cache_dtype", [("llama", "auto"), ("gemma3", "auto"), ("qwen3", "int8")]
)
def test_triton_attention_gives_torchs_greedy_tokens(
    tiny_model_dir, triton_device, arch, kv_cache_dtype
) -> None:
    path = tiny_model_dir(arch)
    ours = _generate(_engine(path, triton_device, kv_cache_dtype, triton=True))
    ref = _generate(_engine(path, triton_device, kv_cache_dtype, triton=False))
    for got, want in zip(ours, ref):
        assert len(got.token_ids) == GREEDY.max_tokens
        assert got.token_ids == want.token_ids
        for g, w in zip(got.logprobs, want.logprobs):
            assert g.sampled.logprob == pytest.approx(
                w.sampled.logprob, abs=LOGPROB_ATOL[kv_cache_dtype]
            )
