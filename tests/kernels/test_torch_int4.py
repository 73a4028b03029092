"""torch's int4 kernel for "q4" weights on CUDA (kernels/torch_int4.py).

On the CPU the conversion's shared part is checked through torch's CPU twin of the kernel
(``_weight_int4pack_mm_for_cpu``: its own tiles, the same scales and zeros, the same
w = (q - 8) · scale + zero): ``operands`` must give it the "q4" weight's values. On a GPU the
whole path runs: the CUDA tiles, the load-time check, the Triton backend's matmul.
Tolerance: the kernel rounds x, scales and zeros to bfloat16 (~0.4% each), within 2% of the
output range; a wrong code, scale or zero is off by the whole range.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import torch_int4
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.quant.int4 import Int4QuantMethod
from tokenmill.quant.int8 import Int8QuantMethod
from tokenmill.quant.packed import TORCH_INT4_KIND, PackedWeight, reference_matmul

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's int4 tiles are CUDA's")


def int4(n: int, k: int, group: int, seed: int = 0) -> PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return Int4QuantMethod(group_size=group).quantize(w, None).weight


def assert_close_to_range(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize(
    "k, group", [(640, 32), (640, 128), (96, 32), (256, 128)]
)  # K: 8, 8, 2 and 8 inner tiles; lane order (640, 256) and element order (96)
def test_operands_are_the_q4_weight_for_torchs_kernel(k: int, group: int) -> None:
    w = int4(32, k, group)  # the CPU twin takes N in 16s (CUDA: 8s)
    assert torch_int4.takes(w)
    codes, scales_and_zeros = torch_int4.operands(w)
    assert codes.shape == (32, k) and scales_and_zeros.shape == (k // group, 32, 2)
    tiles = torch._convert_weight_to_int4pack_for_cpu(codes, torch_int4.inner_k_tiles(k))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    got = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), tiles, group, scales_and_zeros)
    assert_close_to_range(got.float(), reference_matmul(x, w, None, act_int8=False))


def test_which_weights_it_takes() -> None:
    assert torch_int4.inner_k_tiles(640) == 8 and torch_int4.inner_k_tiles(96) == 2
    assert torch_int4.inner_k_tiles(72) is None  # not a multiple of 32
    assert not torch_int4.takes(int4(20, 64, 32))  # 20 output channels: not a multiple of 8
    int8 = Int8QuantMethod().quantize(torch.randn(16, 64), None).weight
    assert not torch_int4.takes(int8)
    # On the CPU nothing is converted: the tiles are CUDA's.
    assert torch_int4.convert(int4(16, 64, 32)) is None


def test_a_converted_weight_has_no_portable_codes() -> None:
    w = int4(16, 64, 32)
    tiles = PackedWeight(TORCH_INT4_KIND, w.codes, w.scales, None, w.group, w.shape)
    with pytest.raises(ValueError, match="no portable codes"):
        tiles.dequantize()


def test_load_asks_the_kernel_backend_for_each_linear_layers_packed_weight(
    tiny_model_dir, caplog
) -> None:
    """CausalLM.bind_kernels hands every linear layer's packed weight (joined groups too) to
    KernelBackend.prepare_packed, keeps what it returns, and logs how many it re-laid."""
    from tokenmill.models.loader import load_model, load_model_config
    from tokenmill.resolve import resolve_model

    class Preparing(TorchKernelBackend):
        """The torch kernels, with each prepared weight's scales halved and codes kept."""

        def prepare_packed(self, w: PackedWeight) -> PackedWeight:
            return PackedWeight(w.kind, w.codes, w.scales / 2, w.offsets, w.group, w.shape)

    config = load_model_config(resolve_model(str(tiny_model_dir("llama"))))
    model = load_model(
        config, torch.float32, torch.device("cpu"), 64, Int4QuantMethod(32), kernels="torch"
    )
    layer = model.model.layers[0]
    before = {name: s.weight.scales.clone() for name, s in _packed_states(layer)}
    with caplog.at_level("INFO", logger="tokenmill.models.base"):
        model.bind_kernels(Preparing(), layer.self_attn.attn.backend)
    assert "torch kernels re-laid packed layers at load:" in caplog.text
    assert "as 'q4'" in caplog.text
    after = dict(_packed_states(layer))
    assert before.keys() == after.keys() and len(after) >= 3
    for name, state in after.items():
        torch.testing.assert_close(state.weight.scales, before[name] / 2)


def _packed_states(layer: torch.nn.Module):
    from tokenmill.layers.linear import FusedLinear, Linear
    from tokenmill.quant.gguf import PackedState

    for name, module in layer.named_modules():
        states = [getattr(module, "quant_state", None)] if isinstance(module, Linear) else []
        if isinstance(module, FusedLinear):
            states = [g.state for g in module.groups]
        for i, state in enumerate(states):
            if isinstance(state, PackedState):
                yield f"{name}.{i}", state


@cuda
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_the_triton_backend_runs_q4_layers_on_torchs_kernel(rows: int) -> None:
    from tokenmill.kernels import create_kernel_backend

    backend = create_kernel_backend("triton")
    w = int4(256, 640, 32).to(torch.device("cuda"))
    prepared = backend.prepare_packed(w)
    assert prepared.kind == TORCH_INT4_KIND
    x = torch.randn(rows, 640, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda")
    got = backend.packed_matmul(x, prepared, bias, act_int8=False)
    assert got.dtype == torch.float32
    assert_close_to_range(got, reference_matmul(x, w, bias, act_int8=False))
