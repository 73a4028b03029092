"""The readable mixture-of-experts MLP: a loop over experts, each on the tokens that chose it.
The oracle of FusedMoE's grouped paths (float, and packed through the kernel backends)."""

from __future__ import annotations

import torch

from tokenmill.kernels.torch_backend import ACTIVATIONS


def reference_moe(
    x: torch.Tensor,  # [T, H]
    router: torch.Tensor,  # [E, H]
    top_k: int,
    renormalize: bool,
    gate_up: torch.Tensor,  # [E, 2I, H]: each expert's [gate | up] rows
    down: torch.Tensor,  # [E, H, I]
    act: str,  # a kernel backends' activation name ("silu", "gelu_tanh")
) -> torch.Tensor:
    x = x.float()
    probs = torch.softmax(x @ router.float().T, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(router.shape[0]):
        token, choice = (ids == e).nonzero(as_tuple=True)
        if len(token) == 0:
            continue
        gate, up = (x[token] @ gate_up[e].float().T).chunk(2, dim=-1)
        out = (ACTIVATIONS[act](gate) * up) @ down[e].float().T
        y.index_add_(0, token, weights[token, choice, None] * out)
    return y
