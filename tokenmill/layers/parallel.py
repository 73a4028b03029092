"""Tensor parallelism's collectives and shard arithmetic (issue 25).

The ranks of one model form torch.distributed's default process group (the multiprocess
executor creates it: gloo on CPU, NCCL on CUDA). Layers call these only when their
``TensorParallel.size`` is above 1, so a single-rank model never touches torch.distributed.

    column-parallel (q/k/v, gate/up, the head):  each rank its rows of W, its slice of y
    row-parallel (o_proj, down_proj):            each rank its columns of W, partial y summed
    vocabulary-parallel embedding:               each rank its rows of the table, summed
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.config import TensorParallel


@dataclass(frozen=True, slots=True)
class Shard:
    """The slice of a checkpoint tensor one rank's layer holds: slice ``idx`` of ``count``
    along ``dim`` (0: rows, a column-parallel layer; 1: columns, a row-parallel one, whose
    partial outputs are summed over the ranks when ``reduce``)."""

    dim: int
    idx: int
    count: int
    reduce: bool = False


def load_shard_(param: torch.Tensor, loaded: torch.Tensor, shard: Shard) -> None:
    """Copy ``shard``'s slice of a checkpoint tensor into ``param``.

    Rows (dim 0) may not divide evenly (a vocabulary): each shard has the same number of
    rows and the last one's rows past the tensor are zero. A row-parallel layer's bias (a
    1-D tensor with dim 1) loads whole on shard 0 and as zeros elsewhere, so the sum over the
    ranks adds it once.
    """
    if loaded.dim() == 1 and shard.dim == 1:
        if tuple(param.shape) != tuple(loaded.shape):
            raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {param.shape}")
        if shard.idx == 0:
            param.copy_(loaded)
        else:
            param.zero_()
        return
    if shard.dim == 0:
        rows = param.shape[0]
        start = shard.idx * rows
        part = loaded[start : start + rows]
        if tuple(part.shape[1:]) != tuple(param.shape[1:]) or loaded.shape[0] > rows * shard.count:
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)} on "
                f"each of {shard.count} shards"
            )
        param[: part.shape[0]].copy_(part)
        param[part.shape[0] :].zero_()
        return
    part = shard_of(loaded, shard.dim, shard.idx, shard.count)
    if tuple(param.shape) != tuple(part.shape):
        raise ValueError(
            f"has shape {tuple(loaded.shape)}, whose shard {tuple(part.shape)} is not the "
            f"model's {tuple(param.shape)}"
        )
    param.copy_(part)


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place."""
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension (rank order)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def shard_size(total: int, num_shards: int) -> int:
    """Rows of one of ``num_shards`` equal shards (the last padded when they do not divide)."""
    return -(-total // num_shards)


def shard_of(loaded: torch.Tensor, dim: int, shard_idx: int, num_shards: int) -> torch.Tensor:
    """Shard ``shard_idx`` of ``num_shards`` equal slices of ``loaded`` along ``dim``."""
    total = loaded.shape[dim]
    if total % num_shards:
        raise ValueError(
            f"has {total} along dimension {dim}, which does not split into {num_shards} "
            "tensor-parallel shards"
        )
    size = total // num_shards
    return loaded.narrow(dim, shard_idx * size, size)


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """[start, end) of the vocabulary rows rank ``tp.rank`` holds (the last rank's may run
    past ``vocab_size``: those rows are zero padding)."""
    size = shard_size(vocab_size, tp.size)
    return tp.rank * size, (tp.rank + 1) * size
