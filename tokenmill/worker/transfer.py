"""Host values onto a step's device without waiting for it: built on the host, pinned and
copied asynchronously on CUDA (the device's queue orders the copy before its readers), as is
on CPU. The sampler's per-row settings and a step's pending-id indices go this way."""

from __future__ import annotations

import torch


def to_device(
    values: list[int] | list[float] | list[bool],
    like: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """A host list as a tensor on ``like``'s device."""
    return host_to_device(torch.tensor(values, dtype=dtype), like)


def host_to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor on ``like``'s device."""
    if like.device.type == "cpu":
        return host
    return host.pin_memory().to(like.device, non_blocking=True)
