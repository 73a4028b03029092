"""The backends chosen at load reach every module, the torch backends make no C call, and a tiny
model gives the same greedy tokens with the torch backends as with the C kernels."""

from __future__ import annotations

import random

import pytest
from conftest import assert_all_blocks_free

from tokenmill.attention import Attention
from tokenmill.attention.backends import TorchAttentionBackend
from tokenmill.engine import LLMEngine
from tokenmill.kernels import cpu_library
from tokenmill.kernels.recording import recording
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
# Float32 kernels against torch, after 12 steps of a tiny random model. An int8 KV cache rounds
# K and V to 8 bits, so a float32-rounding difference upstream can flip a code: 1e-3 there.
LOGPROB_ATOL = 1e-4
LOGPROB_ATOL_INT8_CACHE = 1e-3


def _torch_backends(monkeypatch) -> None:
    """The engine picks the torch backends from here on, as it would without the C kernels."""
    monkeypatch.setattr("tokenmill.worker.worker.default_kernel_backend", lambda _: "torch")


def _engine(path, **kwargs) -> LLMEngine:
    return LLMEngine.from_args(model=str(path), max_model_len=128, kv_cache_memory="8MiB", **kwargs)


def _generate(engine: LLMEngine, seed: int) -> list:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert_all_blocks_free(engine)
    return [done[i] for i in ids]


def _backends(engine: LLMEngine) -> tuple[set[type], set[type]]:
    """The kernel backend types the model's modules hold, and the attention backend types."""
    model = engine.executor.worker.runner.model
    kernels = {type(m.kernels) for m in model.modules() if hasattr(m, "kernels")}
    attention = {type(m.backend) for m in model.modules() if isinstance(m, Attention)}
    return kernels, attention


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_torch_backends_make_no_c_call(tiny_model_dir, monkeypatch, arch, quantization) -> None:
    def no_c_library() -> None:
        raise AssertionError("the torch backends called into the C library")

    _torch_backends(monkeypatch)
    monkeypatch.setattr(cpu_library, "library", no_c_library)
    engine = _engine(tiny_model_dir(arch), quantization=quantization, enforce_eager=True)
    assert _backends(engine) == ({TorchKernelBackend}, {TorchAttentionBackend})
    assert (
        engine.executor.worker.runner.sampler.kernels is engine.executor.worker.runner.model.kernels
    )
    with recording() as rec:
        outputs = _generate(engine, seed=0)
    assert rec.ops == []
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)


def test_kernel_backend_is_picked_by_name(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir("llama"), kernel_backend="torch")
    assert _backends(engine) == ({TorchKernelBackend}, {TorchAttentionBackend})
    with pytest.raises(ValueError, match="kernel_backend must be auto or one of torch, cpu"):
        _engine(tiny_model_dir("llama"), kernel_backend="cuda-graphs")


@pytest.mark.skipif(not cpu_library.available(), reason="C kernels not built here")
@pytest.mark.parametrize(
    "arch, options",
    [
        ("gemma3", {}),
        ("gemma3", {"quantization": "int8", "packed_activations": "float32"}),
        ("gemma3", {"kv_cache_dtype": "int8"}),
        ("llama", {"quantization": "int8", "packed_activations": "float32"}),
        ("mistral", {}),
        ("qwen2", {"quantization": "int8", "packed_activations": "float32"}),
    ],
)
def test_torch_backends_give_the_c_kernels_greedy_tokens(
    tiny_model_dir, monkeypatch, arch, options
) -> None:
    from tokenmill.attention.backends.cpu_backend import CpuAttentionBackend
    from tokenmill.kernels.cpu_backend import CpuKernelBackend

    path = tiny_model_dir(arch)
    fast = _engine(path, **options)
    assert _backends(fast) == ({CpuKernelBackend}, {CpuAttentionBackend})
    _torch_backends(monkeypatch)
    oracle = _engine(path, **options)
    assert _backends(oracle) == ({TorchKernelBackend}, {TorchAttentionBackend})
    atol = LOGPROB_ATOL_INT8_CACHE if options.get("kv_cache_dtype") == "int8" else LOGPROB_ATOL
    for ours, ref in zip(_generate(fast, seed=1), _generate(oracle, seed=1)):
        assert ours.token_ids == ref.token_ids
        for got, want in zip(ours.logprobs, ref.logprobs):
            assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=atol)
