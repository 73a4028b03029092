"""The planner's probes time real kernels on weights they build; those weights must be ones the
kernels compute correctly (else the probe times a path the engine never takes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import create_kernel_backend, default_kernel_backend
from tokenmill.kernels.probe import _GGUF_IDS, _typical, _weight, parse_kind


@pytest.mark.parametrize("weight_type", [*_GGUF_IDS, "int8", "int4"])
def test_probe_weights_run_on_the_engines_kernel_like_their_torch_twin(weight_type) -> None:
    gen = torch.Generator().manual_seed(1)
    w = _weight(weight_type, 64, 256, gen)
    x = torch.randn(16, 256, generator=gen)
    backend = create_kernel_backend(default_kernel_backend(torch.device("cpu")))
    ours = backend.packed_matmul(x, w, None, act_int8=False)
    torch.testing.assert_close(ours, F.linear(x, w.dequantize()), rtol=1e-3, atol=1e-3)
    assert w.shape == (64, 256) and torch.isfinite(w.dequantize()).all()


def test_float_weights_are_plain_tensors_and_unknown_types_are_refused() -> None:
    gen = torch.Generator().manual_seed(2)
    assert isinstance(_weight("F32", 8, 32, gen), torch.Tensor)
    with pytest.raises(ValueError, match="no probe for weight type 'Q1_X'"):
        _weight("Q1_X", 8, 32, gen)


def test_typical_is_the_median_of_at_least_the_asked_number_of_calls() -> None:
    calls = []
    assert _typical(lambda: calls.append(1), runs=7, budget_s=0.0) >= 0.0
    assert len(calls) == 8  # one warm-up, then seven timed


def test_matmul_kinds_read_type_at_inputs() -> None:
    assert parse_kind("Q4_K@4096") == ("Q4_K", 4096)
    for bad in ("Q4_K", "Q4_K@", "Q4_K@x", "Q4_K@0"):
        with pytest.raises(ValueError, match="TYPE@K"):
            parse_kind(bad)
