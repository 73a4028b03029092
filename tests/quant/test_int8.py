"""Int8 weight quantization: the fast path equals its reference, and int8 models track float."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.kernels import create_kernel_backend, default_kernel_backend
from tokenmill.quant import Int8QuantMethod, create_quant_method
from tokenmill.quant.int8 import quantize_per_channel
from tokenmill.sampling_params import SamplingParams

# The C kernels where they are built (the fast path under test), torch otherwise.
KERNELS = create_kernel_backend(default_kernel_backend(torch.device("cpu")))


def test_per_channel_quantization_error_is_bounded() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scale
    q, scales = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * scales[:, None] - w).abs()
    # Rounding error at most half a step of each row's own scale.
    assert torch.all(err <= scales[:, None] / 2 + 1e-7)


def test_zero_rows_survive() -> None:
    w = torch.zeros(3, 8)
    w[1] = 1.0
    q, scales = quantize_per_channel(w)
    assert torch.equal(q.float() * scales[:, None], w)


@pytest.mark.parametrize("shape", [(1, 64, 48), (7, 256, 640), (40, 96, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act_int8", [False, True])
def test_matmul_matches_dequantized_weight(shape, bias, act_int8) -> None:
    torch.manual_seed(1)
    m, n, k = shape
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n) if bias else None
    x = torch.randn(m, k)
    method = Int8QuantMethod(act_int8=act_int8)
    state = method.quantize(w, b)
    q, scales = quantize_per_channel(w)
    assert torch.equal(method.dequantize(state), q.float() * scales[:, None])
    exact = F.linear(x, method.dequantize(state), b)
    y = method.apply(state, x, KERNELS)
    # int8 activations (per 32 elements, small batches only) cost ~0.5% of the output range.
    tol = (0.01 if act_int8 else 1e-5) * exact.abs().max().item()
    assert (y - exact).abs().max().item() <= tol


def test_unknown_method_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        create_quant_method("int3")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_int8_model_greedy_tracks_float(tiny_model_dir, arch) -> None:
    path = str(tiny_model_dir(arch))
    common = dict(model=path, max_model_len=256, kv_cache_memory="8MiB", num_threads=1)
    fp = LLMEngine.from_args(**common)
    q8 = LLMEngine.from_args(**common, quantization="int8")
    assert q8.info.weight_nbytes < fp.info.weight_nbytes / 2
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 259) for _ in range(20)] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    agree_first = 0
    for prompt in prompts:
        outs = []
        for engine in (fp, q8):
            rid = engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == rid and out.finished:
                        outs.append(out.outputs[0])
        agree_first += outs[0].token_ids[0] == outs[1].token_ids[0]
        # The int8 model's first-token log-prob of float's pick stays close.
        assert abs(outs[0].logprobs[0].sampled.logprob - outs[1].logprobs[0].sampled.logprob) < 0.5
    assert agree_first >= 7
    assert_all_blocks_free(fp)
    assert_all_blocks_free(q8)


def test_group_scales_recover_a_q8_0_tensor_exactly() -> None:
    """int4 keeps some layers int8 with a scale per 32 inputs (GGUF Q8_0's layout): a dequantized
    Q8_0 tensor comes back exactly, where one scale a row would round it again."""
    torch.manual_seed(4)
    codes = torch.randint(-127, 128, (16, 8, 32)).float()
    codes[..., 0] = 127  # Q8_0 scales each block to its max
    w = (codes * (torch.rand(16, 8, 1) * 0.01 + 1e-4)).reshape(16, 256)
    grouped = Int8QuantMethod(act_int8=False, group_scales=True).quantize(w, None)
    torch.testing.assert_close(grouped.weight.dequantize(), w, rtol=1e-6, atol=0)
    per_row = Int8QuantMethod(act_int8=False).quantize(w, None)
    assert (per_row.weight.dequantize() - w).abs().max() > 1e-6
