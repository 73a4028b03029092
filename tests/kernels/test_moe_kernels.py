"""The C mixture-of-experts kernels (csrc/moe.c) against their torch twins: the router's ids
exactly and weights to 1e-6; the routed experts for stacked weights of every packed layout, with
float activations to float32 rounding of the twin and with int8 ones to the emulated int8 mode;
and a recorded call that replays on new inputs with no torch op outside the kernels."""

from __future__ import annotations

import functools

import pytest
import torch

from tokenmill.kernels import cpu_library as lib
from tokenmill.kernels.cpu_backend import FLOAT_GEMM_MIN_ROWS, CpuKernelBackend
from tokenmill.kernels.graph import Graph, Scratch
from tokenmill.kernels.recording import OP_NAMES, recording
from tokenmill.kernels.torch_backend import TorchKernelBackend, expert_rows, grouped_experts
from tokenmill.quant.gguf_blocks import BLOCK_CODES
from tokenmill.quant.int4 import Int4QuantMethod
from tokenmill.quant.int8 import Int8QuantMethod
from tokenmill.quant.packed import PackedWeight, concat_rows, pack_gguf, reference_matmul

pytestmark = pytest.mark.skipif(not lib.available(), reason="C kernels not built here")

NUM_EXPERTS = 8
# Layout name -> (hidden, inter): the k-quants' rows come in 256s.
LAYOUTS = {
    "int8": (128, 64),
    "int4": (128, 64),  # "q4" codes with offsets
    "Q8_0": (128, 64),  # "q8" with float16 scales
    "Q5_0": (128, 64),  # "q5" planes, zero point 16, float16 scales
    "Q4_K": (256, 256),  # "q4" with offsets
    "Q6_K": (256, 256),  # "u8" bytes in 16-element groups
}
GGML_TYPES = {"Q8_0": 8, "Q5_0": 6, "Q4_K": 12, "Q6_K": 14}


@pytest.fixture
def cpu() -> CpuKernelBackend:
    return CpuKernelBackend()


@pytest.fixture
def ref() -> TorchKernelBackend:
    return TorchKernelBackend()


def _gguf_weight(ggml_type: int, rows: int, cols: int, seed: int) -> PackedWeight:
    """A packed GGUF tensor of random blocks with finite, modest float16 scales."""
    elems, nbytes, _ = BLOCK_CODES[ggml_type]
    n = rows * cols // elems
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)
    for off in {14: [208]}.get(ggml_type, [0, 2] if ggml_type >= 12 else [0]):
        d = (torch.rand(n, generator=g) * 0.02).half()
        data[:, off : off + 2] = d.view(torch.uint8).reshape(n, 2)
    return pack_gguf(data.reshape(-1), ggml_type, (rows, cols))


def _weight(layout: str, rows: int, cols: int, seed: int) -> PackedWeight:
    if layout in GGML_TYPES:
        return _gguf_weight(GGML_TYPES[layout], rows, cols, seed)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    method = Int8QuantMethod() if layout == "int8" else Int4QuantMethod(group_size=32)
    return method.quantize(w, None).weight


def _stacked_experts(layout: str) -> tuple[PackedWeight, PackedWeight]:
    """Stacked gate_up [E·2I, H] and down [E·H, I] of NUM_EXPERTS experts."""
    hidden, inter = LAYOUTS[layout]
    gate_up = concat_rows([_weight(layout, 2 * inter, hidden, e) for e in range(NUM_EXPERTS)])
    down = concat_rows([_weight(layout, hidden, inter, 100 + e) for e in range(NUM_EXPERTS)])
    assert gate_up is not None and down is not None
    assert lib.supports(gate_up) and lib.supports(down)
    return gate_up, down


# Built once per layout (int4's grid search is slow); read only.
_experts = functools.cache(_stacked_experts)


def _int8_twin(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: PackedWeight,
    down: PackedWeight,
    act: str,
) -> torch.Tensor:
    """The routed experts as the kernel's int8 mode computes them (reference_matmul's emulation;
    TorchKernelBackend.packed_matmul computes in float whatever act_int8 says). act(gate) · up
    is the C kernel's (test_cpu_library checks it against torch): an activation a float32
    rounding apart would now and then round to the next int8 code."""
    hidden, inter = x.shape[1], down.shape[1]

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gu = reference_matmul(xs, expert_rows(gate_up, e, 2 * inter), None, act_int8=True)
        h = lib.act_mul(gu, act)
        return reference_matmul(h, expert_rows(down, e, hidden), None, act_int8=True)

    return grouped_experts(x, weights, ids, NUM_EXPERTS, expert)


def _calls(fn) -> tuple[object, list[str]]:
    """fn()'s result and the names of the C kernels it called."""
    with recording() as rec:
        out = fn()
    return out, [OP_NAMES[row[0]] for row in rec.ops]


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_the_torch_twin(cpu, ref, num_tokens, top_k, renormalize) -> None:
    g = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    x, router = (
        torch.randn(num_tokens, 100, generator=g),
        torch.randn(NUM_EXPERTS, 100, generator=g),
    )
    (weights, ids), calls = _calls(lambda: cpu.moe_route(x, router, top_k, renormalize))
    assert calls == ["moe route"]
    ref_weights, ref_ids = ref.moe_route(x, router, top_k, renormalize)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    # The router logits are float sums in another order than torch's matmul, whose kernel
    # depends on the CPU: weights 1.4e-6 apart on an Intel Xeon with AVX-512 and AMX.
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=5e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens), rtol=0, atol=1e-6)


def test_route_breaks_ties_to_the_lower_index(cpu) -> None:
    """Equal router rows give bit-equal logits: the lower expert comes first (torch.topk's CPU
    order among ties is not specified, so this checks the kernel against the contract)."""
    g = torch.Generator().manual_seed(3)
    router = torch.randn(NUM_EXPERTS, 64, generator=g) * 0.01
    x = torch.randn(2, 64, generator=g)
    router[6] = router[2] = x[0] * 3  # the top two of token 0, tied
    router[5] = x[1] * 3
    weights, ids = cpu.moe_route(x, router, 3, renormalize=False)
    assert ids[0, :2].tolist() == [2, 6] and weights[0, 0] == weights[0, 1]
    assert ids[1, 0] == 5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("act_int8", [False, True])
@pytest.mark.parametrize("extras", [False, True])  # router statistics and a shared expert
def test_experts_match_the_torch_twin(
    cpu, ref, layout, num_tokens, top_k, act, act_int8, extras
) -> None:
    gate_up, down = _experts(layout)
    hidden = down.shape[0] // NUM_EXPERTS
    g = torch.Generator().manual_seed(num_tokens + top_k)
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = ref.moe_route(x, torch.randn(NUM_EXPERTS, hidden, generator=g), top_k, True)
    counts = ref_counts = shared = shared_gate = None
    if extras:
        counts = torch.arange(NUM_EXPERTS)  # adds to what is there
        ref_counts = counts.clone()
        shared = torch.randn(num_tokens, hidden, generator=g)
        shared_gate = torch.randn(hidden, generator=g) * 0.1

    def ours_fn():
        return cpu.moe_experts(
            x, weights, ids, gate_up, down, act, act_int8, counts, shared, shared_gate
        )

    ours, calls = _calls(ours_fn)
    assert calls == ["moe experts"]
    twin = ref.moe_experts(
        x, weights, ids, gate_up, down, act, act_int8, ref_counts, shared, shared_gate
    )
    scale = twin.abs().max().item()
    if extras:
        assert torch.equal(counts, ref_counts)
        assert counts.sum() == NUM_EXPERTS * (NUM_EXPERTS - 1) // 2 + num_tokens * top_k
    if not act_int8:  # float activations: the twin up to float32 rounding
        torch.testing.assert_close(ours, twin, rtol=0, atol=1e-5 * scale)
        return
    # int8 activations (per 32 elements): the emulated int8 mode up to float32 rounding, and
    # within 5% (relative, over all outputs) of the float twin: two matmuls' quantized inputs.
    emulated = _int8_twin(x, weights, ids, gate_up, down, act)
    if shared is not None:
        emulated += torch.sigmoid(x @ shared_gate)[:, None] * shared
    torch.testing.assert_close(ours, emulated, rtol=0, atol=1e-5 * scale)
    assert (ours - twin).norm() < 0.05 * twin.norm()


@pytest.mark.parametrize("act_int8", [False, True])
def test_a_tokens_output_does_not_depend_on_its_batch(cpu, act_int8) -> None:
    """A token's row alone and among 13 other tokens (other experts, other row tiles) is
    bit-equal: greedy decoding gives one answer whatever else is batched with a request."""
    gate_up, down = _experts("Q8_0")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, 128, generator=g)
    weights, ids = cpu.moe_route(x, torch.randn(NUM_EXPERTS, 128, generator=g), 2, True)
    together = cpu.moe_experts(x, weights, ids, gate_up, down, "silu", act_int8)
    for t in (0, 7, 12):
        rows = slice(t, t + 1)
        alone = cpu.moe_experts(x[rows], weights[rows], ids[rows], gate_up, down, "silu", act_int8)
        assert torch.equal(alone[0], together[t])


def test_experts_no_token_chose_are_never_read(cpu, ref) -> None:
    """NaN scales in an expert no token chose leave every output finite (its rows are not
    computed); a token that chose one expert twice gets both shares."""
    gate_up, down = _stacked_experts("int8")  # its own copy: written below
    inter = down.shape[1]
    gate_up.scales[3 * 2 * inter : 4 * 2 * inter] = float("nan")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 128, generator=g)
    ids = torch.tensor([[0, 5], [5, 0], [7, 7], [1, 2]])
    weights = torch.rand(4, 2, generator=g)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    ours = cpu.moe_experts(x, weights, ids, gate_up, down, "silu", False, counts)
    assert ours.isfinite().all()
    assert counts.tolist() == [2, 1, 1, 0, 0, 2, 0, 2]
    twin = ref.moe_experts(x, weights, ids, gate_up, down, "silu", False)
    torch.testing.assert_close(ours, twin, rtol=0, atol=1e-5 * twin.abs().max().item())


def test_inputs_the_kernel_does_not_take_run_the_torch_twin(cpu, ref) -> None:
    gate_up, down = _experts("int4")
    g = torch.Generator().manual_seed(6)
    many = FLOAT_GEMM_MIN_ROWS // 2 + 1  # top-2: past FLOAT_GEMM_MIN_ROWS pairs
    x = torch.randn(many, 128, generator=g)
    weights, ids = ref.moe_route(x, torch.randn(NUM_EXPERTS, 128, generator=g), 2, True)
    cases = [
        (x, "silu", False),  # float activations over many rows: packed_matmul's float GEMM
        (x[:3], "gelu", True),  # erf GELU: no C activation
        (x[:3].double(), "silu", True),
    ]
    for xs, act, act_int8 in cases:
        rows = xs.shape[0]
        args = (xs, weights[:rows], ids[:rows], gate_up, down, act, act_int8)
        ours, calls = _calls(lambda args=args: cpu.moe_experts(*args))
        assert "moe experts" not in calls  # the twin, whose packed matmuls may be C calls
        twin = ref.moe_experts(*args)
        if act_int8:
            assert (ours - twin).norm() < 0.05 * twin.norm()
        else:
            torch.testing.assert_close(ours, twin, rtol=0, atol=1e-5 * twin.abs().max().item())
    (weights64, ids64), calls = _calls(lambda: cpu.moe_route(x.double(), x[:8].double(), 2, True))
    assert calls == [] and torch.equal(ids64, ref.moe_route(x.double(), x[:8].double(), 2, True)[1])


def test_a_recorded_moe_layer_replays_on_new_inputs(cpu) -> None:
    """Route and experts recorded as a decode step records them (no torch op computes outside
    the kernels; intermediates, the experts' work buffer among them, moved into the shared
    scratch), then replayed after x changed in place: the result of a fresh eager call."""
    from tokenmill.worker.decode_graph import _ComputeWatch

    gate_up, down = _experts("Q4_K")
    g = torch.Generator().manual_seed(7)
    router = torch.randn(NUM_EXPERTS, 256, generator=g)
    x = torch.randn(3, 256, generator=g)
    shared, shared_gate = torch.randn(3, 256, generator=g), torch.randn(256, generator=g) * 0.1
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)

    def layer() -> torch.Tensor:
        weights, ids = cpu.moe_route(x, router, 2, True)
        return cpu.moe_experts(
            x, weights, ids, gate_up, down, "silu", True, counts, shared, shared_gate
        )

    watch = _ComputeWatch()
    with recording() as rec, watch:
        y = layer()
    recorded_counts = counts.clone()
    assert watch.computed == []
    assert [OP_NAMES[row[0]] for row in rec.ops] == ["moe route", "moe experts"]
    watch.allocated.discard(y.untyped_storage().data_ptr())  # read after the replay
    scratch = Scratch()
    graph = Graph(rec, scratch, watch.allocated)
    assert scratch.buffer.numel() >= lib.moe_work_bytes(3, 256, 256, NUM_EXPERTS, 2)
    first = y.clone()
    x.copy_(torch.randn(3, 256, generator=g))
    graph.replay()
    assert not torch.equal(y, first)
    replayed_counts = counts.clone()
    expected = layer()
    assert torch.equal(y, expected)
    # The replay counted the new routing as the eager call does.
    assert torch.equal(counts - replayed_counts, replayed_counts - recorded_counts)
    assert counts.sum() == 3 * 3 * 2
