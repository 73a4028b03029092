"""SamplingParams validation: every bad value raises ValueError naming the field and its range."""

from __future__ import annotations

import pytest

from tokenmill.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be an integer >= 1; got 0"),
        (dict(n=1.5), "n must be an integer >= 1"),
        (dict(max_tokens=0), "max_tokens must be an integer >= 1; got 0"),
        (dict(max_tokens=-1), "max_tokens must be"),
        (dict(max_tokens=2.0), "max_tokens must be"),
        (dict(min_tokens=-1), "min_tokens must be an integer >= 0; got -1"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens must be at most max_tokens \(4\); got 5"),
        (dict(temperature=-0.01), "temperature must be >= 0; got -0.01"),
        (dict(top_p=0.0), r"top_p must be \(0, 1\]; got 0.0"),
        (dict(top_p=1.5), r"top_p must be \(0, 1\]; got 1.5"),
        (dict(top_p=-0.2), "top_p must be"),
        (dict(top_k=0), r"top_k must be -1 \(disabled\) or an integer >= 1; got 0"),
        (dict(top_k=-2), "top_k must be .*; got -2"),
        (dict(top_k=2.5), "top_k must be"),
        (dict(min_p=-0.1), r"min_p must be \[0, 1\]"),
        (dict(min_p=1.1), r"min_p must be \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(presence_penalty=2.5), r"presence_penalty must be \[-2, 2\]"),
        (dict(presence_penalty=-2.5), "presence_penalty must be"),
        (dict(frequency_penalty=3.0), r"frequency_penalty must be \[-2, 2\]"),
        (dict(logprobs=-1), r"logprobs must be an integer in \[0, 20\]"),
        (dict(logprobs=21), "logprobs must be"),
        (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*63\); got 1844"),
        (dict(seed=-(2**63) - 1), "seed must be"),
        (dict(seed=1.5), "seed must be"),
        (
            dict(output_kind="streaming"),
            r"output_kind must be one of \[.cumulative., .delta., .final_only.\]; got .streaming.",
        ),
        (dict(stop=[""]), "stop must be a list of non-empty strings"),
        (dict(stop=["ok", 3]), "stop must be"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids >= 0"),
        (dict(stop_token_ids=["2"]), "stop_token_ids must be"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(max_tokens=None, min_tokens=100),
        dict(min_tokens=4, max_tokens=4),
        dict(stop_token_ids=[0]),
        dict(seed=0),
        dict(seed=2**63 - 1),
        dict(seed=-(2**63)),
    ],
)
def test_edge_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(5,)).stop_token_ids == [5]


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (
        1,
        16,
        0,
        1,
        1,
        -1,
    )
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert not p.is_greedy and not p.has_penalties
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_is_greedy_and_has_penalties():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert not SamplingParams(repetition_penalty=1.0).has_penalties
