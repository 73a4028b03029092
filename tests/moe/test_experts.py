"""FusedMoE and its router against the loop-over-experts reference: float experts, packed ones
through each kernel backend, and the loaders' checks."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_library
from tokenmill.kernels.cpu_backend import CpuKernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend, expert_rows
from tokenmill.moe import FusedMoE, Router
from tokenmill.moe.reference import reference_moe
from tokenmill.quant.gguf import PackedQuantMethod
from tokenmill.quant.int8 import Int8QuantMethod

E, H, INTER, K = 8, 64, 32, 2


def _layers(renormalize: bool, seed: int = 0) -> tuple[Router, FusedMoE]:
    torch.manual_seed(seed)
    router = Router(E, H, K, renormalize)
    router.weight.data.normal_(0, 0.5)
    experts = FusedMoE(E, H, INTER, "silu")
    experts.gate_up.data.normal_(0, 0.2)
    experts.down.data.normal_(0, 0.2)
    return router, experts


def _reference(router: Router, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor):
    return reference_moe(x, router.weight, K, router.renormalize, gate_up, down, "silu")


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_float_experts_match_the_reference(renormalize: bool, tokens: int) -> None:
    router, experts = _layers(renormalize)
    x = torch.randn(tokens, H)
    weights, ids = router(x)
    ref = _reference(router, experts.gate_up.data, experts.down.data, x)
    torch.testing.assert_close(experts(x, weights, ids), ref, atol=1e-5, rtol=1e-5)


def test_router_picks_the_top_k_of_the_softmax() -> None:
    router, _ = _layers(renormalize=False)
    x = torch.randn(6, H)
    weights, ids = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    assert torch.equal(ids, probs.topk(K).indices)
    torch.testing.assert_close(weights, probs.topk(K).values)
    router.renormalize = True
    weights, _ = router(x)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))


BACKENDS = [TorchKernelBackend]
if cpu_library.available():
    BACKENDS.append(CpuKernelBackend)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_packed_experts_match_the_reference_of_their_weights(backend, tokens: int) -> None:
    """int8 experts with float activations: the reference over the dequantized stacks."""
    router, experts = _layers(renormalize=True)
    experts.quantize_(Int8QuantMethod(act_int8=False))
    assert set(experts.packed) == {"gate_up", "down"} and experts.gate_up is None
    experts.kernels = router.kernels = backend()
    stacks = experts.packed
    gate_up = torch.stack(
        [expert_rows(stacks["gate_up"], e, 2 * INTER).dequantize() for e in range(E)]
    )
    down = torch.stack([expert_rows(stacks["down"], e, H).dequantize() for e in range(E)])
    x = torch.randn(tokens, H)
    weights, ids = router(x)
    counts = torch.zeros(E, dtype=torch.int64)
    experts.counts = counts
    y = experts(x, weights, ids)
    torch.testing.assert_close(y, _reference(router, gate_up, down, x), atol=1e-4, rtol=1e-4)
    assert counts.sum() == tokens * K
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=E))


def test_an_expert_no_token_chose_is_never_run() -> None:
    _, experts = _layers(renormalize=True)
    ran: list[int] = []
    expert = experts._expert

    def spy(e: int, x: torch.Tensor) -> torch.Tensor:
        ran.append(e)
        return expert(e, x)

    experts._expert = spy  # type: ignore[method-assign]
    x = torch.randn(4, H)
    ids = torch.tensor([[3, 5], [5, 3], [3, 0], [5, 0]])
    experts(x, torch.full((4, 2), 0.5), ids)
    assert ran == [0, 3, 5]


def test_loaders_take_experts_one_by_one_or_stacked() -> None:
    _, experts = _layers(renormalize=True)
    loaders = experts.checkpoint_loaders("mlp.experts")
    gate = torch.randn(E, INTER, H)
    loaders["mlp.experts.gate_proj.weight"](gate, None)  # stacked, as a GGUF holds it
    for e in range(E):
        loaders[f"mlp.experts.{e}.up_proj.weight"](torch.full((INTER, H), float(e)), None)
    assert experts.missing_tensors("mlp.experts") == ["mlp.experts.down_proj.weight"]
    loaders["mlp.experts.3.down_proj.weight"](torch.zeros(H, INTER), None)
    missing = experts.missing_tensors("mlp.experts")
    assert len(missing) == E - 1 and "mlp.experts.3.down_proj.weight" not in missing
    torch.testing.assert_close(experts.gate_up.data[:, :INTER], gate)
    assert experts.gate_up.data[5, INTER:].eq(5.0).all()


def test_loaders_refuse_what_does_not_fit() -> None:
    _, experts = _layers(renormalize=True)
    loaders = experts.checkpoint_loaders("mlp.experts")
    with pytest.raises(ValueError, match="shape"):
        loaders["mlp.experts.0.gate_proj.weight"](torch.zeros(INTER + 1, H), None)
    loaders["mlp.experts.0.gate_proj.weight"](torch.zeros(INTER, H), None)
    with pytest.raises(ValueError, match="twice"):
        loaders["mlp.experts.0.gate_proj.weight"](torch.zeros(INTER, H), None)
    packed = Int8QuantMethod().quantize(torch.randn(E * INTER, H), None).weight
    with pytest.raises(ValueError, match="packed method"):
        loaders["mlp.experts.up_proj.weight"](packed, None)
    wrong = Int8QuantMethod().quantize(torch.randn(E * INTER + 1, H), None).weight
    with pytest.raises(ValueError, match="shape"):
        loaders["mlp.experts.up_proj.weight"](wrong, PackedQuantMethod())
