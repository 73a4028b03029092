"""Recurrent state of linear-attention layers (Gated DeltaNet: Yang et al., 2025), beside the
paged KV cache.

A linear-attention layer keeps no K/V: each request carries, per such layer, a fixed-size
state that every token it computes updates in place:

- ``conv``: the last ``conv_kernel - 1`` inputs of the causal depthwise convolution over
  [q | k | v], ``[slots, conv_dim, conv_kernel - 1]``;
- ``ssm``: per value head, the delta rule's fast-weight matrix ``S``,
  ``[slots, num_v_heads, k_head_dim, v_head_dim]`` float32.

Each running request holds one slot of every layer's tensors (the runner's RecurrentStatePool,
worker/recurrent_state.py, hands them out and zeroes them). A request's state is a function of
every token before it, so it cannot be rebuilt from cached blocks: a preempted request gives
its slot back and recomputes from its first token, and prefix caching is off for these models.

The gated delta rule, per value head, for a token with query q, key k (both L2-normalized,
q scaled by 1/sqrt(d_k)), value v, decay g (log-space) and write strength β::

    S ← exp(g) · S
    S ← S + k (β (v − Sᵀk))ᵀ          (the delta rule: move S's answer for k toward v)
    o = Sᵀ q

``gated_delta_rule`` runs it token by token: the readable form and the chunked one's oracle.
``chunked_gated_delta_rule`` computes the same over chunks of 64 tokens with matrix products
(the WY form of the paper's section 3), for prefills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.config import ModelConfig

# (conv, ssm) of one linear-attention layer: [slots, conv_dim, kernel - 1], [slots, H, dk, dv].
LayerState = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class RecurrentBatch:
    """Which state slot each request of a step reads and updates, in the step's batch order:
    ``num_decodes`` single-token decodes first (token i is request i), then one run of
    ``query_lens[i]`` tokens per other request (a prompt or a chunk of one)."""

    slots: list[int]  # per request, its slot
    query_lens: list[int]
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] long on the device: slots[:num_decodes]


def state_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv, ssm) shape of one slot of a linear-attention layer."""
    lin = config.linear_attention
    assert lin is not None
    return (lin.conv_dim, lin.conv_kernel - 1), (lin.num_v_heads, lin.k_head_dim, lin.v_head_dim)


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes a request's state takes over all linear-attention layers (conv in the model's
    dtype, ssm in float32)."""
    if config.linear_attention is None:
        return 0
    conv, ssm = state_shapes(config)
    per_layer = _numel(conv) * dtype.itemsize + _numel(ssm) * 4
    return per_layer * len(config.linear_layers)


def allocate_states(
    config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[LayerState]:
    """Zeroed (conv, ssm) tensors of ``num_slots`` slots per linear-attention layer."""
    if config.linear_attention is None:
        return []
    conv, ssm = state_shapes(config)
    return [
        (
            torch.zeros((num_slots, *conv), dtype=dtype, device=device),
            torch.zeros((num_slots, *ssm), dtype=torch.float32, device=device),
        )
        for _ in config.linear_layers
    ]


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one request's run ``x`` [T, C] continuing from ``state``
    [C, K-1] (its previous inputs), SiLU after: (out [T, C], the new state [C, K-1])."""
    window = torch.cat([state, x.t().to(state.dtype)], dim=1)  # [C, K-1+T]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])
    return F.silu(out[0].t()).to(x.dtype), window[:, -state.shape[1] :]


def causal_conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token each of a batch: ``x`` [B, C], ``state`` [B, C, K-1] -> (out [B, C], new
    state [B, C, K-1])."""
    window = torch.cat([state, x[:, :, None].to(state.dtype)], dim=2)  # [B, C, K]
    out = (window.to(weight.dtype) * weight[None]).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over a batch of runs of equal length. q, k [B, T, H, dk] (normalized,
    q scaled), v [B, T, H, dv], g and beta [B, T, H], state [B, H, dk, dv] float32 ->
    (out [B, T, H, dv] float32, the final state)."""
    s = state.clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t].float(), k[:, t].float(), v[:, t].float()
        s = s * g[:, t].float().exp()[..., None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - recalled) * beta[:, t].float()[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q_t)
    return out, s


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` for one run (q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state
    [H, dk, dv]) in chunks of ``chunk`` tokens: within a chunk the delta rule's updates are
    solved at once (a unit lower-triangular system: the WY representation), and the state is
    carried from chunk to chunk. -> (out [T, H, dv] float32, the final state)."""
    length = q.shape[0]
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    g, beta = g.float().t(), beta.float().t()  # [H, T]
    s = state.clone()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end]
        # Cumulative decay from the chunk's start: token i sees the state decayed by exp(G_i).
        cum = g[:, start:end].cumsum(-1)  # [H, C]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # decay[i, j] = exp(G_i - G_j) for j <= i: what token j's write has decayed by at i.
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        # The writes u_j = β_j (v_j − (recall of k_j from the state and earlier writes)) solve
        # (I + strictly-lower(β_i k_i·k_j decay_ij)) u = β (v − exp(G) Sᵀk).
        kk = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]
        a = torch.eye(n, device=q.device) + kk.tril(-1)
        rhs = bc[:, :, None] * (vc - (kc * cum.exp()[:, :, None]) @ s)
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # [H, C, dv]
        # o_i = exp(G_i) Sᵀq_i + Σ_{j<=i} decay_ij (q_i·k_j) u_j
        qk = (qc @ kc.transpose(1, 2)) * decay
        out[:, start:end] = (qc * cum.exp()[:, :, None]) @ s + qk @ u
        # S ← exp(G_last) S + Σ_j exp(G_last − G_j) k_j u_jᵀ
        tail = (cum[:, -1:] - cum).exp()  # [H, C]
        s = cum[:, -1, None, None].exp() * s + (kc * tail[:, :, None]).transpose(1, 2) @ u
    return out.transpose(0, 1), s


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
