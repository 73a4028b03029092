"""The linear-attention state (attention/recurrent.py): the chunked gated delta rule equals the
token-by-token one it is tested against, and a run split anywhere (chunked prefill, then
decodes) carries its state to the same result as the run whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.recurrent import (
    causal_conv,
    causal_conv_step,
    chunked_gated_delta_rule,
    gated_delta_rule,
)

H, DK, DV = 3, 8, 6


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(length, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(length, H, DK, generator=gen), dim=-1)
    v = torch.randn(length, H, DV, generator=gen)
    g = -torch.rand(length, H, generator=gen)  # decays in (e^-1, 1]
    beta = torch.rand(length, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_rule_equals_the_token_by_token_rule(length):
    q, k, v, g, beta, state = _inputs(length, seed=length)
    want, want_state = gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state[None])
    got, got_state = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=64)
    torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state[0], atol=1e-4, rtol=1e-4)


def test_a_run_split_in_pieces_carries_its_state():
    q, k, v, g, beta, state = _inputs(40, seed=7)
    whole, whole_state = chunked_gated_delta_rule(q, k, v, g, beta, state)
    s, parts = state, []
    for start, end in [(0, 17), (17, 18), (18, 40)]:  # a chunk, a decode, the rest
        out, s = chunked_gated_delta_rule(
            q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], s
        )
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, whole_state, atol=1e-5, rtol=1e-5)


def test_the_convolution_continues_across_steps():
    """A run through ``causal_conv`` in two pieces, or token by token through
    ``causal_conv_step``, equals the causal convolution of the whole run from a zero state."""
    channels, taps, length = 5, 4, 12
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    padded = F.pad(x.t()[None], (taps - 1, 0))
    want = F.silu(F.conv1d(padded, weight[:, None, :], groups=channels)[0].t())
    state = torch.zeros(channels, taps - 1)
    first, state = causal_conv(x[:7], state, weight)
    rest = []
    for t in range(7, length):
        out, stepped = causal_conv_step(x[t : t + 1], state[None], weight)
        state = stepped[0]
        rest.append(out)
    torch.testing.assert_close(torch.cat([first, *rest]), want, atol=1e-6, rtol=1e-6)
