"""Weight quantization: one QuantMethod per scheme, applied to every Linear after loading."""

from __future__ import annotations

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.int8 import Int8QuantMethod

QUANTIZATION_METHODS = ("int8",)

__all__ = ["QUANTIZATION_METHODS", "Int8QuantMethod", "QuantMethod", "create_quant_method"]


def create_quant_method(name: str) -> QuantMethod:
    if name == "int8":
        return Int8QuantMethod()
    raise ValueError(
        f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset); got {name!r}"
    )
