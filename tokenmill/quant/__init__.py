"""Weight quantization: one QuantMethod per scheme, deciding how each Linear (and the tied
embedding / output head) stores its weight and computes with it."""

from __future__ import annotations

from tokenmill.config import PACKED_ACTIVATIONS, QUANTIZATION_METHODS
from tokenmill.quant.base import QuantMethod
from tokenmill.quant.fp8 import Fp8QuantMethod
from tokenmill.quant.gguf import PackedQuantMethod
from tokenmill.quant.half import HalfQuantMethod
from tokenmill.quant.int4 import Int4QuantMethod
from tokenmill.quant.int8 import Int8QuantMethod

__all__ = [
    "PACKED_ACTIVATIONS",
    "QUANTIZATION_METHODS",
    "Fp8QuantMethod",
    "HalfQuantMethod",
    "Int4QuantMethod",
    "Int8QuantMethod",
    "PackedQuantMethod",
    "QuantMethod",
    "create_quant_method",
]


def create_quant_method(
    name: str, packed_activations: str = "int8", int4_group_size: int = 32, half_kind: str = "bf16"
) -> QuantMethod:
    """``half_kind``: the halves of ``half`` ("bf16", or "f16" for a checkpoint stored so)."""
    act_int8 = packed_activations == "int8"
    if name == "gguf":
        return PackedQuantMethod(act_int8)
    if name == "half":
        return HalfQuantMethod(half_kind)
    if name == "fp8":
        return Fp8QuantMethod()
    if name == "int8":
        return Int8QuantMethod(act_int8)
    if name == "int4":
        return Int4QuantMethod(int4_group_size, act_int8)
    raise ValueError(
        f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset); got {name!r}"
    )
