"""Linear layers y = x Wᵀ (+ b), and fused layers computing several projections of one input.

Parameters are allocated uninitialized; each layer's ``weight_loader`` fills them from checkpoint
tensors (vLLM's layers/linear.py): a Linear takes a tensor whole, a FusedLinear (QKVLinear,
MergedLinear) one part of it at a time (q, k or v; gate or up). Tensor-parallel shards and MoE
experts are further loaders on the same seam.

After loading, ``quantize_`` may hand a weight to a QuantMethod, which packs it and computes
from then on (the float parameter is dropped); a weight that arrives packed (GGUF) is handed
over as it loads. A fused layer then decides from what its parts hold which of them share one
matmul (``group_parts_``): packed parts of one layout have their rows joined, and on CUDA float
parts too; the others are computed part by part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers.parallel import Shard, all_reduce_, load_shard_
from tokenmill.quant.packed import GGUFBlocks, PackedWeight

if TYPE_CHECKING:
    from tokenmill.quant.base import QuantMethod
    from tokenmill.quant.gguf import PackedQuantMethod, PackedState


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | PackedWeight) -> None:
    """Copy a float checkpoint tensor into ``param`` of the same shape."""
    if isinstance(loaded, PackedWeight):
        raise ValueError(
            f"arrived packed (shape {loaded.shape}) where the model keeps a float parameter"
        )
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def packed_weight_loader(
    layer: nn.Module,
    param: nn.Parameter,
    loaded: PackedWeight,
    packed_method: PackedQuantMethod | None,
) -> None:
    """Hand a weight that arrives packed (GGUF) to ``layer.load_packed_`` in place of ``param``
    (whose shape it must have), to be computed by ``packed_method``."""
    if tuple(param.shape) != loaded.shape:
        raise ValueError(
            f"(packed) has shape {loaded.shape}, the model expects {tuple(param.shape)}"
        )
    if packed_method is None:
        raise ValueError("arrived packed but no packed method was given")
    layer.load_packed_(packed_method, loaded.to(param.device))


class Linear(nn.Module):
    """``shard`` (tensor parallelism): the slice of the checkpoint's weight this rank holds;
    ``in_features`` / ``out_features`` are then this rank's. A row-parallel shard
    (``shard.reduce``) sums its partial outputs over the ranks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, shard: Shard | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_method: QuantMethod | None = None
        self.quant_state: Any = None
        self.kernels: KernelBackend = TorchKernelBackend()  # a packed matmul's; bound at load

    def weight_loader(
        self,
        param_name: str,
        loaded: torch.Tensor | PackedWeight | GGUFBlocks,
        packed_method: PackedQuantMethod | None = None,
    ) -> None:
        """Fill ``weight`` or ``bias`` from a checkpoint tensor of its shape (or, with a
        ``shard``, its slice of one; a GGUF weight's slice comes from its GGUFBlocks). A packed weight
        (a GGUF tensor in its block format) is kept packed, computed by ``packed_method``."""
        param = getattr(self, param_name, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"has no place: the layer holds no float {param_name}")
        if self.shard is not None:
            if isinstance(loaded, GGUFBlocks):  # this rank's blocks, packed on their own
                shard = self.shard
                packed = loaded.shard(shard.dim, shard.idx, shard.count).pack()
                packed_weight_loader(self, param, packed, packed_method)
            elif isinstance(loaded, PackedWeight):
                raise ValueError(
                    "arrived packed where a tensor-parallel shard is cut from it (the loader "
                    "gives such weights as GGUFBlocks)"
                )
            else:
                load_shard_(param.data, loaded, self.shard)
        elif isinstance(loaded, PackedWeight) and param_name == "weight":
            packed_weight_loader(self, param, loaded, packed_method)
        else:
            default_weight_loader(param, loaded)

    def quantize_(self, method: QuantMethod, importance: torch.Tensor | None = None) -> None:
        """Pack the weight (``importance``: see QuantMethod.quantize)."""
        self.quant_state = method.quantize(self.weight.data, _data(self.bias), importance)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]
        self.bias = None

    def load_packed_(self, method: PackedQuantMethod, weight: PackedWeight) -> None:
        """Take a weight that arrives packed (GGUF); a bias, if any, loads as a float."""
        self.quant_state = method.wrap(weight)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]

    def fold_bias_(self) -> None:
        """After loading: a packed weight's float bias (GGUF) moves into its state, so the
        matmul kernel adds it and torch computes nothing after the kernel."""
        state = self.quant_state
        if self.bias is not None and getattr(state, "bias", False) is None:
            state.bias = self.bias.data.float().contiguous()
            self.bias = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x Wᵀ + b; into ``out`` when given (the output head's reused logits buffer)."""
        y = self._forward(x, out)
        if self.shard is not None and self.shard.reduce:
            all_reduce_(y)
        return y

    def _forward(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.quant_method.apply(self.quant_state, x, self.kernels, out=out)
        elif out is None:
            return F.linear(x, self.weight, self.bias)
        else:
            y = torch.matmul(x, self.weight.T, out=out)
        if self.bias is None:
            return y
        # A packed GGUF weight keeps its float bias here; quantize_ folded it into the state.
        return y.add_(self.bias) if out is not None else y + self.bias


def _data(p: nn.Parameter | None) -> torch.Tensor | None:
    return None if p is None else p.data


@dataclass(slots=True)
class PartGroup:
    """Parts of a fused layer computed by one matmul, their outputs side by side."""

    parts: tuple[str, ...]
    sizes: tuple[int, ...]  # each part's out_features
    # The parts' packed rows joined (their own Linears then hold nothing); None: one part,
    # computed by its own Linear.
    method: PackedQuantMethod | None = None
    state: PackedState | None = None
    # Float parts joined instead (``join_floats``): the rows of every part, whose own weights
    # are views into it, and their biases (zeros where a part has none).
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


class FusedLinear(nn.Module):
    """Projections of one input, each its own checkpoint tensor (a part): ``forward`` returns
    their outputs in order. Each part loads into its own Linear (``weight_loader``), is quantized
    there like any layer, and after loading the layer decides which parts share a matmul."""

    # Ways to join parts into matmuls, most joined first: each a set of groups, each group
    # consecutive parts in part order; parts in no group run alone.
    groupings: tuple[tuple[tuple[str, ...], ...], ...] = ()

    def __init__(
        self,
        in_features: int,
        part_sizes: dict[str, int],
        bias: bool = False,
        shards: dict[str, Shard] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(part_sizes.values())
        shards = shards or {}
        self.parts = nn.ModuleDict(
            {
                part: Linear(in_features, size, bias, shards.get(part))
                for part, size in part_sizes.items()
            }
        )
        self.groups = [PartGroup((part,), (size,)) for part, size in part_sizes.items()]
        self.kernels: KernelBackend = TorchKernelBackend()  # joined groups' matmul; bound at load

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(self.parts.keys())

    def part(self, name: str) -> Linear:
        return self.parts[name]  # type: ignore[return-value]

    @property
    def is_fused(self) -> bool:
        """All parts run as one matmul (``forward_fused`` gives its output)."""
        return len(self.groups) == 1 and len(self.groups[0].parts) > 1

    def weight_loader(
        self,
        param_name: str,
        loaded: torch.Tensor | PackedWeight,
        part: str,
        packed_method: PackedQuantMethod | None = None,
    ) -> None:
        """Fill ``param_name`` (weight or bias) of part ``part`` from its checkpoint tensor."""
        if part not in self.parts:
            raise ValueError(f"has no part {part!r}; the parts are {', '.join(self.parts)}")
        try:
            self.part(part).weight_loader(param_name, loaded, packed_method)
        except ValueError as e:
            raise ValueError(f"(part {part!r}) {e}") from e

    def group_parts_(self, join_floats: bool | None = None) -> None:
        """After loading (and quantizing): the first of ``groupings`` whose groups can each be
        one packed matmul, their rows joined (fewer, larger matmuls: a decode step's fixed cost
        per call is what they save); otherwise every part alone. Float parts are joined into
        one matmul where ``join_floats`` (by default: on CUDA, where each matmul of a decode
        step is a kernel launch, ~4 us at batch 1 on an H200; a CPU's float path is its exact
        reference mode, whose golden outputs were recorded part by part)."""
        if join_floats is None:
            weight = self.part(self.part_names[0]).weight
            join_floats = weight is not None and weight.device.type == "cuda"
        if join_floats and self._join_floats():
            return
        for grouping in self.groupings:
            joined = [self._joined(parts) for parts in grouping]
            if all(state is not None for state in joined):
                break
        else:
            return
        grouped = {part for parts in grouping for part in parts}
        groups = {parts[0]: (parts, state) for parts, state in zip(grouping, joined)}
        self.groups = []
        for part in self.part_names:
            if part in groups:
                parts, state = groups[part]
                method = self.part(part).quant_method
                sizes = tuple(self.part(p).out_features for p in parts)
                self.groups.append(PartGroup(parts, sizes, method, state))  # type: ignore[arg-type]
                for p in parts:  # computed by the group from now on
                    self.part(p).quant_method, self.part(p).quant_state = None, None
            elif part not in grouped:
                self.groups.append(PartGroup((part,), (self.part(part).out_features,)))

    def _join_floats(self) -> bool:
        """Every part's float rows into one weight, each part's parameters becoming views into
        it (no memory added); False, and nothing changed, unless every part is an unquantized
        float Linear of one dtype."""
        linears = [self.part(p) for p in self.part_names]
        if any(lin.quant_method is not None or lin.weight is None for lin in linears):
            return False
        if len({lin.weight.dtype for lin in linears}) != 1:
            return False
        weight = torch.cat([lin.weight.data for lin in linears])
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat(
                [
                    lin.bias.data if lin.bias is not None else weight.new_zeros(lin.weight.shape[0])
                    for lin in linears
                ]
            )
        sizes, start = [], 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = weight[start : start + rows]
            if lin.bias is not None:
                lin.bias.data = bias[start : start + rows]
            sizes.append(rows)
            start += rows
        self.groups = [PartGroup(self.part_names, tuple(sizes), weight=weight, bias=bias)]
        return True

    def _joined(self, parts: tuple[str, ...]) -> PackedState | None:
        """One packed state computing ``parts`` (rows in order), or None when they are not all
        packed by one method, in one layout, with their biases folded."""
        from tokenmill.quant.gguf import PackedQuantMethod, PackedState
        from tokenmill.quant.packed import concat_rows

        linears = [self.part(p) for p in parts]
        methods = {id(lin.quant_method) for lin in linears}
        if len(methods) != 1 or not isinstance(linears[0].quant_method, PackedQuantMethod):
            return None
        if any(lin.bias is not None for lin in linears):
            return None
        weight = concat_rows([lin.quant_state.weight for lin in linears])
        if weight is None:
            return None
        bias = None
        if any(lin.quant_state.bias is not None for lin in linears):  # Qwen2's q/k/v biases
            bias = torch.cat(
                [
                    lin.quant_state.bias
                    if lin.quant_state.bias is not None
                    else torch.zeros(lin.out_features, dtype=torch.float32)
                    for lin in linears
                ]
            )
        return PackedState(weight, bias)

    def packed_nbytes(self) -> int:
        """Resident bytes of the joined packed states (the parts count their own)."""
        return sum(g.method.nbytes(g.state) for g in self.groups if g.method is not None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each part's x Wᵀ + b, in part order (views into one output where parts share a
        matmul)."""
        outputs: list[torch.Tensor] = []
        for group in self.groups:
            if group.weight is not None:
                outputs += F.linear(x, group.weight, group.bias).split(group.sizes, dim=-1)
            elif group.method is None:
                outputs.append(self.part(group.parts[0])(x))
            else:
                outputs += group.method.apply(group.state, x, self.kernels).split(
                    group.sizes, dim=-1
                )
        return tuple(outputs)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs side by side [..., out_features], from the one matmul (is_fused)."""
        (group,) = self.groups
        if group.weight is not None:
            return F.linear(x, group.weight, group.bias)
        assert group.method is not None, "forward_fused needs is_fused"
        return group.method.apply(group.state, x, self.kernels)


class QKVLinear(FusedLinear):
    """Attention's q, k and v projections (parts "q", "k", "v"). Joined all three where their
    layouts allow, else k with v (int4 keeps k/v int8 while q is int4, quant/int4.py).

    NOTE: q with k alone (v in another format, as in some gemma-3-270m layers) stays apart:
    whether joining them pays is unmeasured, and every model keeps the matmuls its golden
    outputs were recorded with.
    """

    groupings = ((("q", "k", "v"),), (("k", "v"),))

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        shard: Shard | None = None,
        kv_shard: Shard | None = None,
    ) -> None:
        """Head counts are this rank's; ``shard`` is q's slice of the checkpoint, ``kv_shard``
        k's and v's (tensor parallelism: KV heads may be replicated over several ranks)."""
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shards = {"q": shard, "k": kv_shard, "v": kv_shard} if shard is not None else None
        super().__init__(hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias, shards)


class MergedLinear(FusedLinear):
    """Projections of one input joined in one matmul where their layouts allow (the MLP's gate
    and up: parts "gate", "up")."""

    def __init__(
        self,
        in_features: int,
        part_sizes: dict[str, int],
        bias: bool = False,
        shard: Shard | None = None,
    ) -> None:
        """``shard``: every part's slice of its checkpoint tensor (tensor parallelism)."""
        shards = {part: shard for part in part_sizes} if shard is not None else None
        super().__init__(in_features, part_sizes, bias, shards)
        self.groupings = ((tuple(part_sizes),),)
