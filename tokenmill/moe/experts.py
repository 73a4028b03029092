"""A sparse MLP's router and its experts, their weights stacked (Shazeer et al., 2017; Mixtral).

    (p, e) = top-k(softmax(x Rᵀ)),    y = Σ_j p_j · down_{e_j}(act(gate_{e_j} x) · up_{e_j} x)

Checkpoints hold the experts one of two ways, both loaded here through ``checkpoint_loaders``:
a tensor per expert and projection (Hugging Face: ``experts.3.gate_proj.weight``), or one 3-D
tensor per projection holding every expert (llama.cpp's ``ffn_gate_exps``, renamed by the loader
to ``experts.gate_proj.weight``). Either way the experts end up stacked: float parameters
``gate_up`` [E, 2I, H] and ``down`` [E, H, I], or, packed (a GGUF's quantized tensors, or int8 /
int4 at load), one PackedWeight per projection whose rows are the experts' in order (expert e's
[gate | up] rows at e·2I). Packed experts run in one kernel-backend call (``moe_experts``: each
expert once, on its tokens; a decode step's graph records it like any kernel); float ones run
the same grouping in torch (``grouped_experts``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend, expert_rows, grouped_experts
from tokenmill.layers.activation import backend_act
from tokenmill.layers.linear import default_weight_loader
from tokenmill.quant.packed import PackedWeight, concat_rows

if TYPE_CHECKING:
    from tokenmill.quant.base import QuantMethod
    from tokenmill.quant.gguf import PackedQuantMethod

# Checkpoint projection name -> (stacked tensor, part of it).
PROJECTIONS = {"gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}


class Router(nn.Module):
    """The softmax router: a float weight [E, H] (never quantized: it is tiny and picks the
    experts); ``forward`` gives each token's top-k (weights, expert ids)."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k = top_k
        self.renormalize = renormalize
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.moe_route(x, self.weight, self.top_k, self.renormalize)


class FusedMoE(nn.Module):
    """E experts, each a gated MLP down(act(gate x) · up x) of width I, weights stacked."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, act: str
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.act = backend_act(act)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        # Packed stacks, once quantized or loaded packed: "gate_up" (or "gate" and "up" where
        # their layouts differ, until ``stack_``), "down".
        self.packed: dict[str, PackedWeight] = {}
        self.act_int8 = True  # packed matmuls' activations (the packed method's choice)
        # Checkpoint tensors loaded so far, by (projection, expert or None for a stack).
        self._loaded: set[tuple[str, int | None]] = set()
        self._packed_parts: dict[tuple[str, int], PackedWeight] = {}  # per-expert, until stack_
        # Tokens each expert ran, summed over steps (router statistics), when enabled.
        self.counts: torch.Tensor | None = None
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load

    # -- loading -------------------------------------------------------------------------------

    def checkpoint_loaders(self, prefix: str) -> dict[str, Callable[[Any, Any], None]]:
        """Checkpoint tensor name -> its loader (tensor, packed_method): each expert's
        projections, and the stacked 3-D form of each projection."""
        loaders: dict[str, Callable[[Any, Any], None]] = {}
        for proj in PROJECTIONS:
            loaders[f"{prefix}.{proj}.weight"] = functools.partial(self.weight_loader, proj, None)
            for e in range(self.num_experts):
                name = f"{prefix}.{e}.{proj}.weight"
                loaders[name] = functools.partial(self.weight_loader, proj, e)
        return loaders

    def missing_tensors(self, prefix: str) -> list[str]:
        """What the checkpoint has not given yet (each projection whole, or every expert's)."""
        missing = []
        for proj in PROJECTIONS:
            if (proj, None) in self._loaded:
                continue
            absent = [e for e in range(self.num_experts) if (proj, e) not in self._loaded]
            if len(absent) == self.num_experts:
                missing.append(f"{prefix}.{proj}.weight")
            else:
                missing += [f"{prefix}.{e}.{proj}.weight" for e in absent]
        return missing

    @property
    def fully_loaded(self) -> bool:
        return not self.missing_tensors("")

    def weight_loader(
        self,
        proj: str,
        expert: int | None,
        loaded: torch.Tensor | PackedWeight,
        packed_method: PackedQuantMethod | None = None,
    ) -> None:
        """Fill projection ``proj`` of one expert (a 2-D tensor), or of all (``expert`` None:
        a stacked [E, N, K] tensor, or packed as [E·N, K])."""
        stacked, part = PROJECTIONS[proj]
        if (proj, expert) in self._loaded:
            raise ValueError("is loaded twice")
        if isinstance(loaded, PackedWeight):
            self._load_packed(proj, expert, loaded, packed_method)
        else:
            param = getattr(self, stacked).data
            rows = param.shape[1] // (2 if stacked == "gate_up" else 1)
            target = param[:, part * rows : (part + 1) * rows]
            if expert is not None:
                target = target[expert]
            default_weight_loader(target, loaded)  # type: ignore[arg-type]
        self._loaded.add((proj, expert))

    def _load_packed(
        self,
        proj: str,
        expert: int | None,
        loaded: PackedWeight,
        packed_method: PackedQuantMethod | None,
    ) -> None:
        if packed_method is None:
            raise ValueError("arrived packed but no packed method was given")
        rows, cols = self._expert_shape(proj)
        expected = (rows * (self.num_experts if expert is None else 1), cols)
        if loaded.shape != expected:
            raise ValueError(f"(packed) has shape {loaded.shape}, the model expects {expected}")
        self.act_int8 = packed_method.act_int8
        if expert is None:
            self.packed[proj.removesuffix("_proj")] = loaded
        else:
            self._packed_parts[proj, expert] = loaded

    def _expert_shape(self, proj: str) -> tuple[int, int]:
        if proj == "down_proj":
            return self.hidden_size, self.intermediate_size
        return self.intermediate_size, self.hidden_size

    def quantize_(self, method: QuantMethod, importance: torch.Tensor | None = None) -> None:
        """Pack the float experts with ``method``, expert by expert, into stacks."""
        for name in ("gate_up", "down"):
            weights = getattr(self, name).data
            states = [method.quantize(weights[e], None) for e in range(self.num_experts)]
            stack = concat_rows([s.weight for s in states])
            assert stack is not None  # one method, one layout for every expert
            self.packed[name] = stack
            setattr(self, name, None)
        self.act_int8 = getattr(method, "act_int8", True)

    def stack_(self) -> None:
        """After loading: per-expert packed tensors into stacks, and gate with up into one
        [gate | up] stack per expert where their layouts allow (one matmul per expert)."""
        if "gate_up" in self.packed or not (self.packed or self._packed_parts):
            return  # float, or quantized into stacks at load
        for proj in PROJECTIONS:
            name = proj.removesuffix("_proj")
            if name not in self.packed:
                parts = [self._packed_parts.pop((proj, e)) for e in range(self.num_experts)]
                stack = concat_rows(parts)
                if stack is None:
                    raise ValueError(f"experts' {proj} tensors are not all in one format")
                self.packed[name] = stack
        gate, up = self.packed.pop("gate"), self.packed.pop("up")
        i = self.intermediate_size
        joined = concat_rows(
            [
                w
                for e in range(self.num_experts)
                for w in (expert_rows(gate, e, i), expert_rows(up, e, i))
            ]
        )
        if joined is None:  # gate and up in other formats: two matmuls per expert
            self.packed |= {"gate": gate, "up": up}
        else:
            self.packed["gate_up"] = joined
        self.gate_up = None  # type: ignore[assignment]
        self.down = None  # type: ignore[assignment]

    def packed_nbytes(self) -> int:
        return sum(w.nbytes for w in self.packed.values())

    # -- compute -------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Σ_j weights[:, j] · expert_{ids[:, j]}(x) [T, H] (+ sigmoid(x · shared_gate) · shared)."""
        if "gate_up" in self.packed:
            y = self.kernels.moe_experts(
                x,
                weights,
                ids,
                self.packed["gate_up"],
                self.packed["down"],
                self.act,
                self.act_int8,
                self.counts,
                shared,
                shared_gate,
            )
            return y.to(x.dtype)
        y = grouped_experts(x, weights, ids, self.num_experts, self._expert, self.counts)
        if shared is not None:
            y = y + torch.sigmoid(x @ shared_gate.to(x.dtype))[:, None] * shared
        return y

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x: float weights, or packed gate and up apart."""
        if not self.packed:
            gate_up = F.linear(x, self.gate_up[e])
            return F.linear(self.kernels.act_and_mul(gate_up, self.act), self.down[e])
        i, h = self.intermediate_size, self.hidden_size
        matmul = self.kernels.packed_matmul
        gate = matmul(x, expert_rows(self.packed["gate"], e, i), None, self.act_int8)
        up = matmul(x, expert_rows(self.packed["up"], e, i), None, self.act_int8)
        act = self.kernels.act_and_mul(torch.cat([gate, up], dim=-1), self.act)
        return matmul(act, expert_rows(self.packed["down"], e, h), None, self.act_int8).to(x.dtype)
