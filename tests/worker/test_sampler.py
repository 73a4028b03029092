"""Sampler on hand-made logits (no model): greedy, truncation, statistics, seeds, penalties,
min_tokens bans and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import Sampler, SamplingRow

CPU = torch.device("cpu")
EOS = 2
# A small known distribution: p = [0.4, 0.3, 0.2, 0.1].
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = PROBS.log()


def row(
    params: SamplingParams,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingRow:
    return SamplingRow(params, prompt or [], output or [], generator, (EOS,))


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator(device=CPU)
    g.manual_seed(seed)
    return g


def draw(params: SamplingParams, logits: torch.Tensor, num_draws: int, seed: int = 0) -> list[int]:
    """num_draws independent picks from one distribution (one batch row per draw)."""
    sampler = Sampler(CPU, seed=seed)
    batch = logits.expand(num_draws, -1).clone()
    token_ids, _ = sampler(batch, [row(params)] * num_draws)
    return token_ids


def frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double() / len(token_ids)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=1.0, top_k=1)] * 3
    token_ids, logprobs = Sampler(CPU)(logits.clone(), [row(p) for p in params])
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 6


def test_greedy_rows_ignore_the_random_rows_beside_them():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_p=0.5),
    ]
    token_ids, _ = Sampler(CPU)(logits.clone(), [row(p) for p in params])
    assert token_ids[0] == logits[0].argmax().item()
    assert token_ids[2] == logits[2].argmax().item()


@pytest.mark.parametrize(
    "params, allowed, kept_probs",
    [
        (SamplingParams(top_k=2), {0, 1}, [0.4, 0.3]),
        (SamplingParams(top_k=3), {0, 1, 2}, [0.4, 0.3, 0.2]),
        # Exclusive cumulative mass before each token: 0, .4, .7, .9; kept while < top_p.
        (SamplingParams(top_p=0.6), {0, 1}, [0.4, 0.3]),
        (SamplingParams(top_p=0.3), {0}, [0.4]),
        (SamplingParams(top_p=0.85), {0, 1, 2}, [0.4, 0.3, 0.2]),
        # Kept while p >= min_p * max_p (0.4): thresholds 0.24 and 0.12.
        (SamplingParams(min_p=0.6), {0, 1}, [0.4, 0.3]),
        (SamplingParams(min_p=0.3), {0, 1, 2}, [0.4, 0.3, 0.2]),
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}, [0.4, 0.3]),
    ],
)
def test_truncation_never_picks_outside_the_allowed_set(params, allowed, kept_probs):
    num_draws = 4000
    token_ids = draw(params, LOGITS, num_draws)
    assert set(token_ids) == allowed  # every allowed token shows up, nothing else
    # The kept tokens are sampled renormalized.
    expected = torch.tensor(kept_probs, dtype=torch.float64)
    expected /= expected.sum()
    freqs = frequencies(token_ids, 4)[: len(kept_probs)]
    assert torch.allclose(freqs, expected, atol=0.03), freqs


def test_temperature_sampling_matches_the_softmax_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    temperature = 0.7
    num_draws = 20_000
    token_ids = draw(SamplingParams(temperature=temperature), logits, num_draws, seed=1234)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    counts = torch.bincount(torch.tensor(token_ids), minlength=5).double()
    chi2 = (((counts - num_draws * expected) ** 2) / (num_draws * expected)).sum().item()
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
    assert chi2 < 18.47, (chi2, counts / num_draws, expected)
    # And a temperature of 2 flattens it measurably.
    hot = frequencies(draw(SamplingParams(temperature=2.0), logits, num_draws, seed=7), 5)
    assert torch.allclose(hot, torch.softmax(logits.double() / 2.0, dim=-1), atol=0.015)


def test_same_seed_gives_the_same_draws_whatever_else_is_in_the_batch():
    vocab = 64
    torch.manual_seed(3)
    logits_seq = [torch.randn(vocab) * 0.5 for _ in range(12)]  # flat-ish: draws vary
    params = SamplingParams(temperature=1.0, seed=42)

    def run(batch_builder) -> list[int]:
        gen = seeded(42)
        sampler = Sampler(CPU, seed=0)
        picks = []
        for step, logits in enumerate(logits_seq):
            rows, batch, idx = batch_builder(step, logits, gen)
            token_ids, _ = sampler(torch.stack(batch), rows)
            picks.append(token_ids[idx])
        return picks

    def alone(step, logits, gen):
        return [row(params, generator=gen)], [logits], 0

    def crowded(step, logits, gen):
        others = [torch.randn(vocab) for _ in range(3 + step % 3)]
        rows = [row(SamplingParams(temperature=1.0)) for _ in others]
        rows.insert(1, row(params, generator=gen))
        rows.append(row(SamplingParams(temperature=0.8, seed=7), generator=seeded(7)))
        batch = [*others[:1], logits, *others[1:], torch.randn(vocab)]
        return rows, batch, 1

    first = run(alone)
    assert len(set(first)) > 3
    assert run(alone) == first
    assert run(crowded) == first


def test_unseeded_rows_use_the_sampler_seed():
    logits = torch.zeros(8, 100)
    rows = [row(SamplingParams(temperature=1.0))] * 8
    a, _ = Sampler(CPU, seed=5)(logits.clone(), rows)
    b, _ = Sampler(CPU, seed=5)(logits.clone(), rows)
    c, _ = Sampler(CPU, seed=6)(logits.clone(), rows)
    assert a == b
    assert a != c


def penalized(params: SamplingParams, logits: torch.Tensor, prompt, output) -> torch.Tensor:
    out = Sampler._apply_penalties_and_bans(logits.clone()[None], [row(params, output, prompt)])
    return out[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 0.5, 1.0])
    out = penalized(SamplingParams(repetition_penalty=2.0), logits, prompt=[0, 1], output=[2, 3])
    # Tokens seen in prompt or output: 0, 1, 2, 3; tokens 4, 5 unchanged.
    assert out.tolist() == [1.0, -2.0, 1.5, -4.0, 0.5, 1.0]
    # A penalty below 1 favours repeats instead.
    out = penalized(SamplingParams(repetition_penalty=0.5), logits, prompt=[0], output=[3])
    assert out.tolist() == [4.0, -1.0, 3.0, -1.0, 0.5, 1.0]


def test_presence_and_frequency_penalties_count_only_output_tokens():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalized(params, logits, prompt=[0, 0, 4], output=[3, 3, 3, 1])
    # logit - frequency * count - presence * (count > 0)
    assert out.tolist() == pytest.approx([1.0, 1.0 - 0.25 - 0.5, 1.0, 1.0 - 0.75 - 0.5, 1.0])
    negative = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    out = penalized(negative, logits, prompt=[], output=[2, 2])
    assert out.tolist() == pytest.approx([1.0, 1.0, 3.0, 1.0, 1.0])


def test_penalties_change_the_greedy_pick():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    plain, _ = Sampler(CPU)(logits.clone(), [row(SamplingParams(temperature=0.0), output=[1])])
    assert plain == [1]
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    picked, _ = Sampler(CPU)(logits.clone(), [row(params, output=[1])])
    assert picked == [2]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    picked, _ = Sampler(CPU)(logits.clone(), [row(params, prompt=[1])])
    assert picked == [2]


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = torch.tensor([0.0, 1.0, 9.0, 2.0, 8.0, 3.0])  # EOS (2) then stop id 4 are likeliest
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    sampler = Sampler(CPU)
    for output in ([], [1]):
        picked, _ = sampler(logits.clone()[None], [row(params, output)])
        assert picked == [5]
    picked, _ = sampler(logits.clone()[None], [row(params, [1, 1])])
    assert picked == [2]
    # ignore_eos: EOS is not banned (it does not stop anyway); stop ids still are.
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4], ignore_eos=True)
    picked, _ = sampler(logits.clone()[None], [row(params)])
    assert picked == [2]
    banned = penalized(SamplingParams(min_tokens=1, stop_token_ids=[4]), logits, [], [])
    assert banned[2] == banned[4] == float("-inf")
    assert torch.isfinite(banned[[0, 1, 3, 5]]).all()
    # Random sampling never picks a banned token either.
    params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[4])
    flat = torch.zeros(6)
    flat[[2, 4]] = 5.0
    assert not {2, 4} & set(draw(params, flat, 2000))


def test_logprobs_are_those_of_the_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, logprobs=0, seed=1),
        SamplingParams(temperature=0.0),
    ]
    rows = [
        row(params[0], prompt=list(range(10))),
        row(params[1], generator=seeded(1)),
        row(params[2]),
    ]
    token_ids, logprobs = Sampler(CPU)(logits.clone(), rows)
    ref = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        lp = logprobs[i]
        (sampled,) = lp.sampled
        assert sampled.token_id == token_ids[i]
        assert sampled.logprob == pytest.approx(ref[i, token_ids[i]].item(), abs=1e-6)
        assert sampled.rank == int((ref[i] > ref[i, token_ids[i]]).sum()) + 1
    assert logprobs[1].top == [[]]  # logprobs=0: the sampled token only
    (top,) = logprobs[0].top
    assert [t.rank for t in top] == [1, 2, 3, 4, 5]
    values, ids = ref[0].sort(descending=True)
    assert [t.token_id for t in top] == ids[:5].tolist()
    assert [t.logprob for t in top] == pytest.approx(values[:5].tolist(), abs=1e-6)
    assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
    assert logprobs[2] is None


def test_logprob_rank_of_an_unlikely_pick():
    # A penalty moves the greedy pick to the raw logits' third token; rank and logprob stay raw.
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2, frequency_penalty=2.0)
    token_ids, logprobs = Sampler(CPU)(logits.clone(), [row(params, output=[0, 0, 0, 1, 1])])
    assert token_ids == [2]
    (sampled,) = logprobs[0].sampled
    assert sampled.rank == 3
    assert sampled.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-6)
    assert math.isfinite(sampled.logprob)


# ---- rejection sampling of a draft model's tokens ---------------------------------------------


def verified(q: torch.Tensor, num_draws: int, seed: int) -> tuple[list[int], float]:
    """Each of num_draws rows verifies a draft d ~ q against p = PROBS: the kept tokens and
    the fraction of drafts kept."""
    g = seeded(seed)
    drafts = torch.multinomial(q, num_draws, replacement=True, generator=g).tolist()
    rows = []
    for d in drafts:
        r = row(SamplingParams(temperature=1.0))
        r.draft_token_id, r.draft_probs = d, q
        rows.append(r)
    token_ids, _ = Sampler(CPU, seed=seed)(LOGITS.expand(num_draws, -1).clone(), rows)
    kept = sum(t == d for t, d in zip(token_ids, drafts)) / num_draws
    return token_ids, kept


@pytest.mark.parametrize(
    "q",
    [
        torch.tensor([0.4, 0.3, 0.2, 0.1]),  # the target itself: every draft kept
        torch.tensor([0.1, 0.2, 0.3, 0.4]),  # reversed
        torch.tensor([0.0, 0.0, 0.05, 0.95]),  # a bad draft: nearly always the least likely
    ],
)
def test_verified_tokens_follow_the_target_whatever_the_draft(q):
    """Chi-square of the kept tokens against p (3 degrees of freedom, P(chi2 > 16.27) = 0.001),
    and the acceptance rate is the theory's: sum over x of min(p(x), q(x))."""
    num_draws = 20_000
    token_ids, kept = verified(q, num_draws, seed=11)
    counts = torch.bincount(torch.tensor(token_ids), minlength=4).double()
    expected = num_draws * PROBS.double()
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 16.27, (chi2, counts / num_draws)
    assert kept == pytest.approx(torch.minimum(PROBS, q).sum().item(), abs=0.015)


def test_keeping_every_draft_would_fail_the_same_test():
    """The test above has power: tokens drawn from the bad draft itself are far from p."""
    q = torch.tensor([0.0, 0.0, 0.05, 0.95])
    drafts = torch.multinomial(q, 20_000, replacement=True, generator=seeded(11))
    counts = torch.bincount(drafts, minlength=4).double()
    expected = 20_000 * PROBS.double()
    assert (((counts - expected) ** 2) / expected).sum().item() > 1_000


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])  # flat (the full sort), middling, peaked
def test_top_p_cut_is_the_sorted_definition(scale):
    """The nucleus found among the top 128 / 1,024 candidates, or by sorting the row when they
    hold too little mass, is the one a full sort defines."""
    from tokenmill.worker.sampler import _top_p_drop

    g = seeded(3)
    logits = torch.randn(6, 5000, generator=g) * scale
    top_p = torch.tensor([0.5, 0.8, 0.9, 0.95, 0.99, 0.3])
    probs = logits.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    beyond = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    want = torch.zeros_like(beyond).scatter(1, order, beyond)
    assert torch.equal(_top_p_drop(logits, top_p), want)


# ---- grammar bitmasks ----------------------------------------------------------------------


def bitmask_allowing(allowed: list[int], num_rows: int, vocab: int) -> torch.Tensor:
    from tokenmill.structured.bitmask import allocate_bitmask

    bitmask = allocate_bitmask(num_rows, vocab).zero_()
    for t in allowed:
        bitmask[:, t >> 5] |= 1 << (t & 31)
    return bitmask


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),  # masked only when a pick is refused
        SamplingParams(temperature=1.0, top_k=3),  # masked before truncation
        SamplingParams(temperature=1.0, top_p=0.9),
    ],
)
def test_a_bitmask_restricts_picks_to_the_masked_distribution(params):
    """Tokens 1 and 3 allowed of p = [0.4, 0.3, 0.2, 0.1] padded to 40 tokens: greedy picks 1,
    random picks follow p restricted to {1, 3} and renormalized (chi-square, 1 degree of
    freedom, P(chi2 > 10.83) = 0.001)."""
    vocab, num_draws = 40, 20_000
    logits = torch.full((vocab,), -30.0)
    logits[:4] = LOGITS
    bitmask = bitmask_allowing([1, 3], num_draws, vocab)
    sampler = Sampler(CPU, seed=5)
    batch = logits.expand(num_draws, -1).clone()
    token_ids, _ = sampler(batch, [row(params)] * num_draws, (bitmask, list(range(num_draws))))
    counts = torch.bincount(torch.tensor(token_ids), minlength=vocab).double()
    assert counts.sum() == counts[1] + counts[3]
    if params.is_greedy:
        assert counts[1] == num_draws
        return
    want = torch.tensor([0.3, 0.1]) / 0.4
    if params.top_p < 1.0:  # the nucleus of the masked distribution: 0.75 + 0.25 > 0.9
        want = torch.tensor([0.75, 0.25])
    expected = num_draws * want.double()
    got = torch.stack([counts[1], counts[3]])
    assert (((got - expected) ** 2) / expected).sum().item() < 10.83, got / num_draws


# ---- one transfer to the host a call ----------------------------------------------------------

_TRANSFERS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def count_transfers(monkeypatch) -> list[str]:
    """Every call of a Tensor method that brings values to the host (on CUDA, a wait for the
    device), by name, from now on."""
    calls: list[str] = []
    for name in _TRANSFERS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_a_mixed_batch_moves_to_the_host_once(monkeypatch):
    """Greedy, seeded, truncated, penalized, biased, banned and draft-verifying rows, with and
    without log-probs: their picks and log-probs come back in one transfer."""
    torch.manual_seed(7)
    logits = torch.randn(6, 300)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.05, frequency_penalty=0.5, logit_bias={4: 2.0}),
        SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[9]),
        SamplingParams(temperature=1.0, logprobs=2),  # verifies a draft
        SamplingParams(temperature=0.0),
    ]
    rows = [row(p, output=[4, 5, 4], prompt=[1, 2, 3]) for p in params]
    rows[1].generator = seeded(3)
    rows[4].draft_token_id, rows[4].draft_probs = 7, torch.softmax(torch.randn(300), dim=-1)
    expected = Sampler(CPU, seed=1)(logits.clone(), rows)
    rows[1].generator = seeded(3)
    calls = count_transfers(monkeypatch)
    got = Sampler(CPU, seed=1)(logits.clone(), rows)
    assert calls == ["tolist"]
    assert got == expected
    token_ids, logprobs = got
    assert [lp is None for lp in logprobs] == [False, False, True, True, False, True]
    assert [len(lp.top[0]) for lp in logprobs if lp is not None] == [3, 0, 2]


def test_greedy_rows_without_logprobs_move_once(monkeypatch):
    logits = torch.randn(4, 50)
    calls = count_transfers(monkeypatch)
    token_ids, _ = Sampler(CPU)(logits.clone(), [row(SamplingParams(temperature=0.0))] * 4)
    assert calls == ["tolist"]
    monkeypatch.undo()
    assert token_ids == logits.argmax(dim=-1).tolist()
