"""TritonKernelBackend against its TorchKernelBackend twin: each Triton op on float32 and
bfloat16 inputs at sizes that are not multiples of the kernels' blocks, the packed matmul over
weights packed by the real int8 / int4 methods (lane order and element order), the ops that stay
torch's, and the registry and chooser. Inputs are drawn on the CPU and moved to conftest.py's
``triton_device``, where both backends run: compiled kernels on CUDA tensors where a GPU is
present, else Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1).

Tolerances: float32 1e-5 (the kernels compute what torch computes, in another order); bfloat16
rtol 1.6e-2 (~2 ulps: the interpreter rounds float32 -> bfloat16 toward zero, torch to nearest,
and act_and_mul rounds once where torch rounds twice); the bf16 packed matmul within 1% of the
output range (W meets x rounded to bfloat16, as on tensor cores; a wrong code or scale is off
by the output range itself).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import (  # noqa: E402  (after the importorskip)
    KERNEL_BACKENDS,
    create_kernel_backend,
    default_kernel_backend,
)
from tokenmill.kernels.torch_backend import TorchKernelBackend  # noqa: E402
from tokenmill.quant.gguf_blocks import BlockCodes  # noqa: E402
from tokenmill.quant.int4 import Int4QuantMethod  # noqa: E402
from tokenmill.quant.int8 import Int8QuantMethod  # noqa: E402
from tokenmill.quant.packed import PackedWeight, from_block_codes, lane_order  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


@pytest.fixture(scope="module")
def triton_backend():
    backend = create_kernel_backend("triton")
    assert backend.name == "triton"
    return backend


@pytest.fixture(scope="module")
def ref():
    return TorchKernelBackend()


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """How often each Triton entry point ran (a fallback to torch would pass every comparison)."""
    from tokenmill.kernels import triton_backend as tb

    counts: dict[str, int] = {}
    for module, name in [
        (tb.norm, "rmsnorm"),
        (tb.rotary, "rope_neox_"),
        (tb.rotary, "qk_norm_rope_"),
        (tb.activation, "act_and_mul"),
        (tb.quant_matmul, "packed_matmul"),
    ]:
        fn = getattr(module, name)

        def spy(*args, fn=fn, name=name, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return counts


def test_registry_and_chooser(monkeypatch) -> None:
    from tokenmill import kernels
    from tokenmill.kernels.triton_backend import TritonKernelBackend

    assert "triton" in KERNEL_BACKENDS
    assert type(create_kernel_backend("triton")) is TritonKernelBackend
    assert default_kernel_backend(torch.device("cuda")) == "triton"
    monkeypatch.setattr(kernels, "_has_triton", lambda: False)
    assert default_kernel_backend(torch.device("cuda")) == "torch"
    assert default_kernel_backend(torch.device("cpu")) in ("cpu", "torch")  # Triton never


def test_tokenmill_imports_and_runs_torch_kernels_without_triton() -> None:
    """With triton unimportable: tokenmill, its kernels and layers load, the torch backend
    runs, CUDA defaults to torch, and picking "triton" is a ValueError that says why."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, tokenmill, tokenmill.layers, tokenmill.quant\n"
        "from tokenmill.kernels import create_kernel_backend, default_kernel_backend\n"
        "assert create_kernel_backend('torch').add(torch.ones(2), torch.ones(2)).sum() == 4\n"
        "assert default_kernel_backend(torch.device('cuda')) == 'torch'\n"
        "try:\n"
        "    create_kernel_backend('triton')\n"
        "except ValueError as e:\n"
        "    assert 'needs the triton package' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no ValueError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])  # 1.0: Gemma's (1 + w)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(triton_device, triton_backend, ref, calls, dtype, offset, with_residual) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 72, generator=g) * 3).to(dtype)  # 72: not a power of two
    weight = torch.randn(72, generator=g)
    residual = torch.randn(5, 72, generator=g).to(dtype) if with_residual else None
    x, weight = x.to(triton_device), weight.to(triton_device)
    residual = None if residual is None else residual.to(triton_device)
    ours = triton_backend.rmsnorm(x, weight, offset, 1e-6, residual)
    want = ref.rmsnorm(x, weight, offset, 1e-6, residual)
    assert ours.dtype == want.dtype == dtype
    torch.testing.assert_close(ours, want, **TOL[dtype])
    assert calls == {"rmsnorm": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_of_heads_inside_a_fused_projection(
    triton_device, triton_backend, ref, dtype
) -> None:
    """q's heads (q_norm) are a strided view of the q/k/v output, read without a copy."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 4 * 24 + 2 * 24, generator=g).to(dtype).to(triton_device)
    q = qkv[:, : 4 * 24].view(3, 4, 24)
    weight = torch.randn(24, generator=g).to(dtype).to(triton_device)  # a bf16 model's weight
    ours = triton_backend.rmsnorm(q, weight, 0.0, 1e-6)
    torch.testing.assert_close(ours, ref.rmsnorm(q, weight, 0.0, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_at_scattered_positions_with_gqa(
    triton_device, triton_backend, ref, calls, dtype
) -> None:
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 5, 63, 17, 2, 40, 9], device=triton_device)
    head_dim, num_heads, num_kv_heads = 24, 4, 2  # half 12: not a power of two
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    freqs = torch.outer(torch.arange(64.0), inv_freq)
    cos, sin = freqs.cos().to(triton_device), freqs.sin().to(triton_device)
    qkv = torch.randn(7, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    qkv = qkv.to(triton_device)
    q = qkv[:, : num_heads * head_dim].view(7, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(7, 2, head_dim)
    before = q.clone()
    want_q, want_k = ref.rotary(positions, q.clone(), k.clone(), cos, sin)
    assert not torch.allclose(want_q[2].float(), before[2].float())  # position 63 rotates
    ours_q, ours_k = triton_backend.rotary(positions, q, k, cos, sin)
    assert ours_q.data_ptr() == q.data_ptr() and ours_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(ours_q, want_q, **TOL[dtype])
    torch.testing.assert_close(ours_k, want_k, **TOL[dtype])
    assert calls == {"rope_neox_": 2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Qwen 3's weight, Gemma 3's (1 + w)
@pytest.mark.parametrize("head_dim", [24, 256])  # half 12: not a power of two; Gemma 3's
def test_qk_norm_rotary_is_one_kernel_with_the_twins_result(
    triton_device, triton_backend, ref, calls, dtype, offset, head_dim
) -> None:
    """QK-norm and RoPE of q's and k's heads, views of one q/k/v output, in one launch: what
    the torch twin's rmsnorm of each then rotary gives."""
    g = torch.Generator().manual_seed(3)
    n, num_heads, num_kv_heads = 7, 4, 2
    positions = torch.tensor([0, 5, 63, 17, 2, 40, 9], device=triton_device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    freqs = torch.outer(torch.arange(64.0), inv_freq)
    cos, sin = freqs.cos().to(triton_device), freqs.sin().to(triton_device)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (3 * torch.randn(n, width, generator=g)).to(dtype).to(triton_device)
    q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(n, num_kv_heads, head_dim)
    q_w, k_w = (torch.randn(head_dim, generator=g).to(dtype).to(triton_device) for _ in "qk")
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    want_q, want_k = ref.qk_norm_rotary(
        positions, q.clone(), k.clone(), q_w, k_w, offset, 1e-6, cos, sin
    )
    ours_q, ours_k = triton_backend.qk_norm_rotary(
        positions, q, k, q_w, k_w, offset, 1e-6, cos, sin
    )
    assert ours_q.data_ptr() == q.data_ptr() and ours_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(ours_q, want_q, **TOL[dtype])
    torch.testing.assert_close(ours_k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)  # v untouched
    assert calls == {"qk_norm_rope_": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul(triton_device, triton_backend, ref, calls, dtype, act) -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(2, 3, 2 * 50, generator=g) * 4).to(dtype)  # d = 50; far tails too
    gate_up[0, 0, :4] = torch.tensor([-30.0, 30.0, -90.0, 90.0]).to(dtype)
    gate_up = gate_up.to(triton_device)
    ours = triton_backend.act_and_mul(gate_up, act)
    want = ref.act_and_mul(gate_up, act)
    assert ours.shape == want.shape == (2, 3, 50) and ours.dtype == dtype
    torch.testing.assert_close(ours, want, **TOL[dtype])
    assert calls == {"act_and_mul": 1}


def _int8(n: int, k: int, seed: int) -> PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return Int8QuantMethod().quantize(w, None).weight


def _int4(n: int, k: int, seed: int, group: int) -> PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return Int4QuantMethod(group_size=group).quantize(w, None).weight


# (name, weight): lane order with blocks of 8 + 2 chunks (320) and 4 + 2 (192), element order
# (40: int8's one group a row; 96: int4's 16-byte chunks), and int4's 128 groups.
LAYOUTS = {
    "int8-k320": lambda: _int8(70, 320, seed=10),
    "int8-k40": lambda: _int8(70, 40, seed=11),
    "int4g32-k192": lambda: _int4(70, 192, seed=12, group=32),
    "int4g32-k96": lambda: _int4(70, 96, seed=13, group=32),
    "int4g128-k256": lambda: _int4(70, 256, seed=14, group=128),
}


def _assert_matmul_close(ours: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.dtype == torch.float32 and ours.shape == want.shape
    scale = want.abs().max().item()
    atol = (1e-5 if dtype == torch.float32 else 1e-2) * scale
    torch.testing.assert_close(ours, want, rtol=0, atol=atol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmul(triton_device, triton_backend, ref, calls, layout, rows, with_bias) -> None:
    w = LAYOUTS[layout]()
    assert w.kind == ("q8" if layout.startswith("int8") else "q4")
    assert (lane_order(w.shape[1]) is None) == (w.shape[1] % 64 != 0)
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(w.shape[0], generator=g) if with_bias else None
    x = torch.randn(rows, w.shape[1], generator=g)
    w, x = w.to(triton_device), x.to(triton_device)
    bias = None if bias is None else bias.to(triton_device)
    for dtype in DTYPES:
        xd = x.to(dtype)
        ours = triton_backend.packed_matmul(xd, w, bias, act_int8=True)
        _assert_matmul_close(ours, ref.packed_matmul(xd, w, bias, act_int8=False), dtype)
    assert calls == {"packed_matmul": 2}


def test_packed_matmul_writes_into_out(triton_device, triton_backend, ref) -> None:
    w = LAYOUTS["int4g32-k192"]().to(triton_device)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(20)).to(triton_device)
    out = torch.full((3, 70), float("nan"), device=triton_device)
    ours = triton_backend.packed_matmul(x, w, None, act_int8=False, out=out)
    assert ours is out
    _assert_matmul_close(out, ref.packed_matmul(x, w, None, act_int8=False), torch.float32)


def _gguf_like(zero: int | None, seed: int) -> PackedWeight:
    """A Q4_0-like ("q4", float16 scales, codes + 8) or, with ``zero``, a Q5_0-like
    ("u8") weight [40, 128], built as the GGUF reader builds them."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-8, 8) if zero is None else (-16, 16)
    codes = torch.randint(low, high, (40 * 4, 32), generator=g, dtype=torch.int16)
    scales = torch.rand(40 * 4, 1, generator=g) * 0.1 + 0.01
    bc = BlockCodes(codes, scales, None, 32)
    return from_block_codes(bc, 40, 128, four_bit=zero is None, f16_scales=True, zero=zero)


def test_gguf_layouts_q4_runs_triton_others_run_torch(
    triton_device, triton_backend, ref, calls
) -> None:
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(21)).to(triton_device)
    q4 = _gguf_like(None, seed=22).to(triton_device)
    assert q4.kind == "q4" and q4.scales.dtype == torch.float16 and q4.zero == 8
    want = ref.packed_matmul(x, q4, None, act_int8=False)
    _assert_matmul_close(triton_backend.packed_matmul(x, q4, None, False), want, torch.float32)
    assert calls == {"packed_matmul": 1}
    u8 = _gguf_like(16, seed=23).to(triton_device)
    assert u8.kind == "u8"
    ours = triton_backend.packed_matmul(x, u8, None, act_int8=False)
    assert torch.equal(ours, ref.packed_matmul(x, u8, None, act_int8=False))
    assert calls == {"packed_matmul": 1}  # the "u8" weight went to the torch twin


def test_ops_without_a_triton_kernel_are_the_torch_twins(
    triton_device, triton_backend, ref, calls
) -> None:
    g = torch.Generator().manual_seed(30)
    x, y = torch.randn(4, 40, generator=g), torch.randn(4, 40, generator=g)
    table, ids = torch.randn(50, 24, generator=g), torch.tensor([[7, 0], [49, 7]])
    router = torch.randn(6, 40, generator=g)
    x, y, table, ids, router = (t.to(triton_device) for t in (x, y, table, ids, router))
    assert torch.equal(triton_backend.add(x, y), ref.add(x, y))
    assert torch.equal(triton_backend.embedding(table, ids, 2.0), ref.embedding(table, ids, 2.0))
    assert torch.equal(triton_backend.argmax(x), ref.argmax(x))
    for a, b in zip(
        triton_backend.moe_route(x, router, 2, True), ref.moe_route(x, router, 2, True)
    ):
        assert torch.equal(a, b)
    assert calls == {}
