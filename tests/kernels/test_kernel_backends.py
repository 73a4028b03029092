"""Kernel backends: the registry and chooser, each CpuKernelBackend op against its
TorchKernelBackend twin (exact where the C kernel computes what torch does, else a stated
tolerance), the C kernels really running (recorded) where inputs fit and torch where not, and
quant/ never importing the kernels at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import (
    KERNEL_BACKENDS,
    create_kernel_backend,
    default_kernel_backend,
)
from tokenmill.kernels import cpu_library as lib
from tokenmill.kernels.recording import OP_NAMES, recording
from tokenmill.kernels.torch_backend import ACTIVATIONS, TorchKernelBackend
from tokenmill.quant.int4 import Int4QuantMethod
from tokenmill.quant.int8 import Int8QuantMethod
from tokenmill.quant.packed import reference_matmul

needs_c = pytest.mark.skipif(not lib.available(), reason="C kernels not built here")
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 kernels that sum or use their own exp/tanh


@pytest.fixture
def cpu():
    from tokenmill.kernels.cpu_backend import CpuKernelBackend

    return CpuKernelBackend()


@pytest.fixture
def ref():
    return TorchKernelBackend()


def _recorded(fn) -> tuple[object, list[str]]:
    """fn()'s result and the names of the C kernels it called."""
    with recording() as rec:
        out = fn()
    return out, [OP_NAMES[row[0]] for row in rec.ops]


def test_registry_creates_by_name_and_rejects_unknown_names() -> None:
    assert KERNEL_BACKENDS == ("torch", "cpu", "triton")
    assert type(create_kernel_backend("torch")) is TorchKernelBackend
    with pytest.raises(ValueError, match="kernel backend must be one of torch, cpu, triton"):
        create_kernel_backend("tpu")


def test_default_backend_is_cpu_only_where_the_c_kernels_load() -> None:
    assert default_kernel_backend(torch.device("meta")) == "torch"
    expected = "cpu" if lib.available() else "torch"
    assert default_kernel_backend(torch.device("cpu")) == expected


def test_cpu_backend_refuses_to_run_without_the_c_kernels(monkeypatch) -> None:
    monkeypatch.setattr(lib, "library", lambda: None)
    with pytest.raises(ValueError, match="C kernels are not built"):
        create_kernel_backend("cpu")


@needs_c
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(cpu, ref, offset, with_residual) -> None:
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 64, generator=g) * 3, torch.randn(64, generator=g)
    residual = torch.randn(5, 64, generator=g) if with_residual else None
    ours, calls = _recorded(lambda: cpu.rmsnorm(x, weight, offset, 1e-6, residual))
    assert calls == ["rmsnorm"]
    torch.testing.assert_close(ours, ref.rmsnorm(x, weight, offset, 1e-6, residual), **TOL)
    # q's heads inside a fused q/k/v projection's output: read in place.
    qkv = torch.randn(3, 4 * 16 + 2 * 16, generator=g)
    q = qkv[:, :64].view(3, 4, 16)
    ours, calls = _recorded(lambda: cpu.rmsnorm(q, weight[:16], offset, 1e-6))
    assert calls == ["rmsnorm"]
    torch.testing.assert_close(ours, ref.rmsnorm(q, weight[:16], offset, 1e-6), **TOL)


@needs_c
def test_ops_that_do_not_fit_run_the_torch_code(cpu, ref) -> None:
    """Other dtypes, widths the kernels do not take, or NaN rows: torch runs, the same ops."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 12, generator=g), torch.randn(12, generator=g)  # 12: not in 8s
    wide = torch.randn(4, 64, generator=g, dtype=torch.float64)
    nan = torch.randn(3, 40, generator=g)
    nan[1, 3] = float("nan")
    cases = [
        ("rmsnorm", (x, w, 1.0, 1e-6, None)),
        ("rmsnorm", (wide, wide[0], 0.0, 1e-6, wide)),
        ("act_and_mul", (torch.randn(4, 24, generator=g), "silu")),  # d = 12
        ("act_and_mul", (torch.randn(4, 64, generator=g), "gelu")),  # no C erf-GELU
        ("add", (wide, wide)),
        ("embedding", (wide, torch.tensor([3, 0]), 2.0)),
        ("argmax", (nan,)),
    ]
    for op, args in cases:
        ours, calls = _recorded(lambda op=op, args=args: getattr(cpu, op)(*args))
        assert calls == [], op
        assert torch.equal(ours, getattr(ref, op)(*args)), op


@needs_c
def test_rotary_in_place_on_views_of_a_fused_projection(cpu, ref) -> None:
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 5, 63, 17])
    freqs = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32))
    cos, sin = freqs.cos(), freqs.sin()
    qkv = torch.randn(4, 3 * 32 + 2 * 32, generator=g)
    q, k = qkv[:, :96].view(4, 3, 32), qkv[:, 96:128].view(4, 1, 32)
    ref_q, ref_k = ref.rotary(positions, q.clone(), k.clone(), cos, sin)
    (ours_q, ours_k), calls = _recorded(lambda: cpu.rotary(positions, q, k, cos, sin))
    assert calls == ["rope", "rope"]
    assert ours_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(ours_q, ref_q, **TOL)
    torch.testing.assert_close(ours_k, ref_k, **TOL)


@needs_c
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul(cpu, ref, act) -> None:
    gate_up = torch.randn(3, 2 * 48, generator=torch.Generator().manual_seed(3)) * 4
    ours, calls = _recorded(lambda: cpu.act_and_mul(gate_up, act))
    assert calls == ["act*mul"]
    torch.testing.assert_close(ours, ref.act_and_mul(gate_up, act), **TOL)
    assert set(ACTIVATIONS) >= set(lib.ACTIVATIONS)  # every C activation has its torch twin


@needs_c
def test_add_and_float_embedding_are_exact(cpu, ref) -> None:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(7, 40, generator=g), torch.randn(7, 40, generator=g)
    ours, calls = _recorded(lambda: cpu.add(x, y))
    assert calls == ["add"] and torch.equal(ours, ref.add(x, y))
    table, ids = torch.randn(50, 24, generator=g), torch.tensor([[7, 0], [49, 7]])
    for scale in (None, 8.0**0.5):
        ours, calls = _recorded(lambda scale=scale: cpu.embedding(table, ids, scale))
        assert calls == ["embedding (float)"]
        assert torch.equal(ours, ref.embedding(table, ids, scale))


@needs_c
def test_argmax_is_exact_with_ties(cpu, ref) -> None:
    x = torch.randn(4, 1003, generator=torch.Generator().manual_seed(5))
    x[1, 5] = x[1, 900] = 50.0  # the first index wins, as in torch
    x[2, 1001] = 60.0  # in the tail past the last 8-wide step
    assert torch.equal(cpu.argmax(x), ref.argmax(x))


def test_token_bitmask_matches_the_torch_twin(cpu, ref) -> None:
    """Words of all ones (skipped), all zeros (filled), mixed bits, and a vocabulary that ends
    inside a word; only the listed rows change."""
    g = torch.Generator().manual_seed(6)
    vocab = 1003
    logits = torch.randn(3, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 32), dtype=torch.int32, generator=g)
    bitmask[0, :10] = -1
    bitmask[0, 10:20] = 0
    ours, want = logits.clone(), logits.clone()
    cpu.apply_token_bitmask_(ours, bitmask, [0, 2])
    ref.apply_token_bitmask_(want, bitmask, [0, 2])
    assert torch.equal(ours, want)
    assert torch.equal(ours[1], logits[1])
    allowed = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert [bool(x) for x in torch.isfinite(want[0]).tolist()] == [bool(a) for a in allowed]


def _packed(n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return Int4QuantMethod(group_size=32).quantize(w, None).weight


@needs_c
@pytest.mark.parametrize("rows", [1, 5, 200])  # 200: at or past FLOAT_GEMM_MIN_ROWS, tiles
def test_packed_matmul_float_activations(cpu, ref, rows, monkeypatch) -> None:
    w = _packed(96, 256, seed=6)
    bias = torch.randn(96)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr("tokenmill.kernels.cpu_backend.TILE_ELEMENTS", 256 * 40)  # 3 tiles
    expected = ref.packed_matmul(x, w, bias, act_int8=False)
    ours, calls = _recorded(lambda: cpu.packed_matmul(x, w, bias, act_int8=False))
    assert calls == (["matmul"] if rows < 128 else [])  # the float GEMM is torch's
    atol = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(ours, expected, rtol=0, atol=atol)


@needs_c
def test_packed_matmul_int8_activations_and_layouts_the_kernel_does_not_read(cpu, ref) -> None:
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    w = _packed(40, 256, seed=9)
    ours = cpu.packed_matmul(x, w, None, act_int8=True)
    # The torch backend computes in float: int8 activations (per 32 elements) stay within 3% of
    # the output range of it, and equal the emulated int8 mode up to float32 rounding.
    expected = ref.packed_matmul(x, w, None, act_int8=True)
    scale = expected.abs().max().item()
    assert (ours - expected).abs().max() < 0.03 * scale
    emulated = reference_matmul(x, w, None, act_int8=True)
    torch.testing.assert_close(ours, emulated, rtol=0, atol=1e-5 * scale)
    # Rows of 48 elements (not in 64s): the kernel's lane order does not apply, torch computes.
    odd = Int8QuantMethod().quantize(torch.randn(8, 48), None).weight
    assert not lib.supports(odd)
    x48 = torch.randn(2, 48)
    ours, calls = _recorded(lambda: cpu.packed_matmul(x48, odd, None, act_int8=True))
    assert calls == [] and torch.equal(ours, ref.packed_matmul(x48, odd, None, act_int8=True))


@needs_c
def test_packed_embedding(cpu, ref) -> None:
    w = _packed(50, 64, seed=10)
    ids = torch.tensor([[7, 0], [49, 7]])
    for scale in (None, 2.5):
        ours, calls = _recorded(lambda scale=scale: cpu.packed_embedding(w, ids, scale))
        assert calls == ["embedding"]
        assert torch.equal(ours, ref.packed_embedding(w, ids, scale))  # the same dequantized rows


def test_quant_never_imports_the_kernels_at_run_time() -> None:
    """The kernels read quant/packed.py's layout; quant/ takes a backend as an argument and may
    name it only for type checking (no import cycle)."""
    quant_dir = Path(__file__).parents[2] / "tokenmill" / "quant"
    for path in sorted(quant_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        type_checking = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        ]
        hidden = {id(n) for block in type_checking for n in ast.walk(block)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in hidden:
                assert not (node.module or "").startswith("tokenmill.kernels"), path.name
                assert not (
                    node.module == "tokenmill" and "kernels" in {a.name for a in node.names}
                )
