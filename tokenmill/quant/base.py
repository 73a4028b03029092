"""QuantMethod: how a linear layer stores its weight and computes y = x Wᵀ + b with it.

A method turns a float weight into its own packed state once, after loading, and computes with
that state from then on. Every method has a pure-torch reference (``dequantize``), the oracle of
its fast path in tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tokenmill.kernels.base import KernelBackend


class QuantMethod:
    """Base class of weight-quantization schemes (one instance serves every layer)."""

    name: str = ""

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> Any:
        """Pack a float weight [out, in] (and bias) into this method's state. ``importance``
        [in]: the mean square of each input over a calibration text, for schemes whose
        rounding can use it (int4); the others ignore it."""
        raise NotImplementedError  # each scheme packs its own way

    def apply(
        self,
        state: Any,
        x: torch.Tensor,
        kernels: KernelBackend,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = x Wᵀ + b for x [..., in] with the packed state, computed by ``kernels`` (the
        layer's backend); returns x's dtype. ``out``: a float32 [rows, out] tensor to write y
        into (the runner reuses one for the logits)."""
        raise NotImplementedError  # each scheme computes its own way

    def dequantize(self, state: Any) -> torch.Tensor:
        """The float weight the state stands for (reference path and tests)."""
        raise NotImplementedError  # each scheme unpacks its own way

    def method_for(self, module_name: str, is_head: bool) -> QuantMethod:
        """The method for one layer, named as in the model (``model.layers.3.self_attn.v_proj``;
        ``is_head``: the output head or a tied embedding). A scheme may keep some layers wider."""
        return self

    def nbytes(self, state: Any) -> int:
        """Resident bytes of the packed state."""
        raise NotImplementedError  # each scheme knows its own layout
