"""Weight loaders of the linear layers: q/k/v (or gate/up) parts loaded into one fused layer
compute what separate layers compute, float or packed; which parts share a matmul follows their
formats; a mis-shaped part is refused by name.

Float parts are compared bit for bit (each part is its own matmul). Packed parts that share a
matmul run one kernel over their joined rows; each output row is the same dot products, so the
comparison allows float rounding only (1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import Linear, MergedLinear, QKVLinear
from tokenmill.quant import Int4QuantMethod, Int8QuantMethod, PackedQuantMethod
from tokenmill.quant.packed import quantize_int4

HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 64, 16, 4, 2
SIZES = {"q": NUM_HEADS * HEAD_DIM, "k": NUM_KV_HEADS * HEAD_DIM, "v": NUM_KV_HEADS * HEAD_DIM}


def _weights(bias: bool, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(seed)
    return {
        part: (
            torch.randn(size, HIDDEN, generator=g),
            torch.randn(size, generator=g) if bias else None,
        )
        for part, size in SIZES.items()
    }


def _separate(weights, bias: bool) -> dict[str, Linear]:
    layers = {}
    for part, (w, b) in weights.items():
        layer = Linear(HIDDEN, w.shape[0], bias=bias)
        layer.weight_loader("weight", w)
        if b is not None:
            layer.weight_loader("bias", b)
        layers[part] = layer
    return layers


def _fused(weights, bias: bool) -> QKVLinear:
    qkv = QKVLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bias=bias)
    for part, (w, b) in weights.items():
        qkv.weight_loader("weight", w, part)
        if b is not None:
            qkv.weight_loader("bias", b, part)
    return qkv


def _finish(layers: list[Linear]) -> None:
    """What the model loader does after loading."""
    for layer in layers:
        layer.fold_bias_()


@pytest.mark.parametrize("bias", [False, True])
def test_float_parts_compute_what_separate_layers_compute(bias: bool) -> None:
    weights = _weights(bias)
    separate, qkv = _separate(weights, bias), _fused(weights, bias)
    qkv.group_parts_()
    assert [g.parts for g in qkv.groups] == [("q",), ("k",), ("v",)]  # floats: part by part
    assert not qkv.is_fused
    x = torch.randn(5, HIDDEN)
    for part, y in zip("qkv", qkv(x), strict=True):
        assert torch.equal(y, separate[part](x))


@pytest.mark.parametrize("bias", [False, True])
def test_joined_float_parts_are_one_matmul_over_views_of_one_weight(bias: bool) -> None:
    """join_floats (CUDA's default): one matmul, each part's parameters views into the joined
    rows (no second copy), the same outputs as separate layers to float32 rounding."""
    weights = _weights(bias, seed=2)
    separate, qkv = _separate(weights, bias), _fused(weights, bias)
    qkv.group_parts_(join_floats=True)
    (group,) = qkv.groups
    assert group.parts == ("q", "k", "v") and group.sizes == tuple(SIZES.values())
    assert qkv.is_fused
    for part in "qkv":
        layer = qkv.part(part)
        assert layer.weight.untyped_storage().data_ptr() == group.weight.data_ptr()
        if bias:
            assert layer.bias.untyped_storage().data_ptr() == group.bias.data_ptr()
    x = torch.randn(5, HIDDEN)
    for part, y in zip("qkv", qkv(x), strict=True):
        torch.testing.assert_close(y, separate[part](x), rtol=1e-5, atol=1e-5)
    fused = qkv.forward_fused(x)
    torch.testing.assert_close(fused, torch.cat([separate[p](x) for p in "qkv"], dim=-1))


def test_only_float_parts_of_one_dtype_join() -> None:
    weights = _weights(False, seed=3)
    qkv = _fused(weights, False)
    qkv.part("v").weight.data = qkv.part("v").weight.data.double()
    qkv.group_parts_(join_floats=True)
    assert [g.parts for g in qkv.groups] == [("q",), ("k",), ("v",)]


@pytest.mark.parametrize("bias", [False, True])
def test_packed_parts_of_one_layout_share_one_matmul(bias: bool) -> None:
    """Packed q/k/v (as GGUF hands them over) join into one matmul, with Qwen2's biases."""
    weights = _weights(bias, seed=1)
    method = PackedQuantMethod(act_int8=False)
    packed = {part: quantize_int4(w, 32) for part, (w, _) in weights.items()}
    separate = {}
    qkv = QKVLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, bias=bias)
    for part, (_, b) in weights.items():
        layer = Linear(HIDDEN, SIZES[part], bias=bias)
        layer.weight_loader("weight", packed[part], method)
        qkv.weight_loader("weight", packed[part], part, method)
        if b is not None:
            layer.weight_loader("bias", b)
            qkv.weight_loader("bias", b, part)
        separate[part] = layer
    _finish([*separate.values(), *qkv.parts.values()])
    qkv.group_parts_()
    assert qkv.is_fused and qkv.groups[0].parts == ("q", "k", "v")
    assert all(qkv.part(p).quant_state is None for p in "qkv")  # the group computes them
    x = torch.randn(3, HIDDEN)
    joined = qkv.forward_fused(x)
    assert joined.shape == (3, sum(SIZES.values()))
    for part, y in zip("qkv", qkv(x), strict=True):
        torch.testing.assert_close(y, separate[part](x), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat(qkv(x), dim=-1), joined)


def test_int4_joins_key_and_value_only() -> None:
    """int4 packs q as int4 and k/v as int8 (quant/int4.py): q runs alone, k and v together."""
    weights = _weights(False, seed=2)
    int4 = Int4QuantMethod(32, act_int8=False)
    qkv = _fused(weights, False)
    separate = _separate(weights, False)
    for part, name in zip("qkv", ("q_proj", "k_proj", "v_proj"), strict=True):
        method = int4.method_for(f"model.layers.0.self_attn.{name}", is_head=False)
        qkv.part(part).quantize_(method)
        separate[part].quantize_(method)
    qkv.group_parts_()
    assert [g.parts for g in qkv.groups] == [("q",), ("k", "v")]
    assert qkv.part("q").quant_state.weight.kind == "q4"
    assert qkv.groups[1].state.weight.kind == "q8"
    x = torch.randn(4, HIDDEN)
    for part, y in zip("qkv", qkv(x), strict=True):
        torch.testing.assert_close(y, separate[part](x), rtol=1e-5, atol=1e-5)


def test_parts_in_different_layouts_stay_apart() -> None:
    """A v in another format than q/k (as in some gemma-3-270m layers): no part is joined."""
    weights = _weights(False, seed=3)
    method = PackedQuantMethod(act_int8=False)
    int8 = Int8QuantMethod(act_int8=False)
    qkv = _fused(weights, False)
    for part in "qk":
        w = qkv.part(part).weight.data
        qkv.part(part).load_packed_(method, quantize_int4(w, 32))
    qkv.part("v").quantize_(int8)
    qkv.group_parts_()
    assert [g.parts for g in qkv.groups] == [("q",), ("k",), ("v",)]
    assert all(qkv.part(p).quant_state is not None for p in "qkv")


def test_merged_gate_up_joins_both_or_neither() -> None:
    g = torch.Generator().manual_seed(4)
    weights = {
        "gate": torch.randn(96, HIDDEN, generator=g),
        "up": torch.randn(96, HIDDEN, generator=g),
    }
    int8 = Int8QuantMethod(act_int8=False)
    for up_method in (int8, Int4QuantMethod(32, act_int8=False)):
        methods = {"gate": int8, "up": up_method}
        mlp = MergedLinear(HIDDEN, {"gate": 96, "up": 96})
        separate = {}
        for part, w in weights.items():
            mlp.weight_loader("weight", w, part)
            mlp.part(part).quantize_(methods[part])
            separate[part] = Linear(HIDDEN, 96)
            separate[part].weight_loader("weight", w)
            separate[part].quantize_(methods[part])
        mlp.group_parts_()
        assert mlp.is_fused == (up_method is int8)
        x = torch.randn(2, HIDDEN)
        for part, y in zip(("gate", "up"), mlp(x), strict=True):
            torch.testing.assert_close(y, separate[part](x), rtol=1e-5, atol=1e-5)


def test_a_mis_shaped_part_is_refused_by_name() -> None:
    qkv = QKVLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS)
    with pytest.raises(ValueError, match=r"part 'k'.*shape \(48, 64\).*\(32, 64\)"):
        qkv.weight_loader("weight", torch.randn(48, HIDDEN), "k")
    packed = quantize_int4(torch.randn(48, HIDDEN), 32)
    with pytest.raises(ValueError, match=r"part 'v'.*packed.*\(48, 64\)"):
        qkv.weight_loader("weight", packed, "v", PackedQuantMethod())
    with pytest.raises(ValueError, match="no part 'o'"):
        qkv.weight_loader("weight", torch.randn(32, HIDDEN), "o")
    with pytest.raises(ValueError, match="no float bias"):
        qkv.weight_loader("bias", torch.randn(32), "v")
    with pytest.raises(ValueError, match="no packed method"):
        qkv.weight_loader("weight", quantize_int4(torch.randn(32, HIDDEN), 32), "v")
