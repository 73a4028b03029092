"""SamplingParams validation, as a property: for any mix of field values (right and wrong
types, out-of-range numbers, NaN and infinities, bools where integers belong), construction
succeeds exactly when an independent oracle written from the documented ranges says the values
are valid, and otherwise raises ValueError whose message names a field. No other exception
escapes: the server turns ValueError into a 400, anything else would be a 500."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling_params import SamplingParams, StructuredOutputs

# Anything a caller might pass by mistake.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, 3), max_size=2),
    st.dictionaries(st.integers(-3, 3), st.integers(-3, 3), max_size=2),
)
SMALL_INTS = st.integers(-3, 40)
REALS = st.one_of(st.floats(-3.0, 3.0), st.integers(-3, 3))
TOKEN_IDS = st.lists(st.one_of(st.integers(-2, 500), st.booleans()), max_size=3)
STOPS = st.one_of(
    st.none(),
    st.text(max_size=3),
    st.lists(st.one_of(st.text(max_size=3), st.integers()), max_size=3),
)
LOGIT_BIAS = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(st.integers(-2, 500), st.booleans(), st.text(max_size=1)),
        st.one_of(st.floats(-150, 150), st.floats(allow_nan=True), st.booleans()),
        max_size=3,
    ),
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "n": SMALL_INTS,
    "max_tokens": st.one_of(st.none(), SMALL_INTS),
    "min_tokens": SMALL_INTS,
    "temperature": REALS,
    "top_p": REALS,
    "top_k": SMALL_INTS,
    "min_p": REALS,
    "repetition_penalty": REALS,
    "presence_penalty": REALS,
    "frequency_penalty": REALS,
    "seed": st.one_of(st.none(), st.integers(-(2**64), 2**64)),
    "stop": STOPS,
    "stop_token_ids": st.one_of(st.none(), TOKEN_IDS),
    "include_stop_str_in_output": st.booleans(),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), SMALL_INTS),
    "prompt_logprobs": st.one_of(st.none(), SMALL_INTS),
    "skip_special_tokens": st.booleans(),
    "logit_bias": LOGIT_BIAS,
    "speculative": st.booleans(),
    "structured_outputs": st.one_of(
        st.none(), st.just(StructuredOutputs(regex="[ab]+")), st.text(max_size=2)
    ),
}


@st.composite
def field_values(draw: st.DrawFn) -> dict[str, Any]:
    """A few fields, each usually from its plausible range, sometimes junk."""
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True))
    return {
        name: draw(st.one_of(FIELDS[name], JUNK) if draw(st.integers(0, 5)) == 0 else FIELDS[name])
        for name in names
    }


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v: Any) -> bool:
    return _int(v) or (isinstance(v, float) and math.isfinite(v))


def _opt_int_in(v: Any, lo: int, hi: int) -> bool:
    return v is None or (_int(v) and lo <= v <= hi)


def is_valid(kw: dict[str, Any]) -> bool:
    """The documented ranges, written independently of SamplingParams.__post_init__."""
    d = {
        "n": 1, "max_tokens": 16, "min_tokens": 0, "temperature": 1.0, "top_p": 1.0,
        "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "seed": None, "stop": None, "stop_token_ids": None,
        "logprobs": None, "prompt_logprobs": None, "logit_bias": None,
        "include_stop_str_in_output": False, "ignore_eos": False, "skip_special_tokens": True,
        "speculative": True, "structured_outputs": None,
    } | kw  # fmt: skip
    stop = [d["stop"]] if isinstance(d["stop"], str) else d["stop"]
    checks = [
        _int(d["n"]) and d["n"] >= 1,
        d["max_tokens"] is None or (_int(d["max_tokens"]) and d["max_tokens"] >= 1),
        _int(d["min_tokens"]) and d["min_tokens"] >= 0,
        _real(d["temperature"]) and d["temperature"] >= 0,
        _real(d["top_p"]) and 0 < d["top_p"] <= 1,
        _int(d["top_k"]) and (d["top_k"] == -1 or d["top_k"] >= 1),
        _real(d["min_p"]) and 0 <= d["min_p"] <= 1,
        _real(d["repetition_penalty"]) and d["repetition_penalty"] > 0,
        _real(d["presence_penalty"]) and -2 <= d["presence_penalty"] <= 2,
        _real(d["frequency_penalty"]) and -2 <= d["frequency_penalty"] <= 2,
        d["seed"] is None or (_int(d["seed"]) and -(2**63) <= d["seed"] < 2**63),
        stop is None
        or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)),
        d["stop_token_ids"] is None
        or (
            isinstance(d["stop_token_ids"], (list, tuple))
            and all(_int(t) and t >= 0 for t in d["stop_token_ids"])
        ),
        _opt_int_in(d["logprobs"], 0, 20),
        _opt_int_in(d["prompt_logprobs"], 0, 20),
        d["logit_bias"] is None
        or (
            isinstance(d["logit_bias"], dict)
            and all(_int(t) and t >= 0 for t in d["logit_bias"])
            and all(_real(b) and -100 <= b <= 100 for b in d["logit_bias"].values())
        ),
        all(
            isinstance(d[name], bool)
            for name in (
                "include_stop_str_in_output",
                "ignore_eos",
                "skip_special_tokens",
                "speculative",
            )
        ),  # fmt: skip
        d["structured_outputs"] is None or isinstance(d["structured_outputs"], StructuredOutputs),
    ]
    if all(checks) and d["max_tokens"] is not None and d["min_tokens"] > d["max_tokens"]:
        return False
    return all(checks)


@settings(max_examples=600, deadline=None)
@given(field_values())
def test_valid_iff_the_oracle_says_so_and_errors_are_value_errors(kw: dict[str, Any]) -> None:
    valid = is_valid(kw)
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        assert not valid, f"rejected valid {kw}: {e}"
        field = str(e).split(" ", 1)[0]
        assert field in FIELDS, f"message does not start with a field name: {e}"
        return
    assert valid, f"accepted invalid {kw}: {params}"
    # What was accepted is normalized: lists and a dict, whatever container came in.
    assert isinstance(params.stop, list) and isinstance(params.stop_token_ids, list)
    assert isinstance(params.logit_bias, dict)
    if isinstance(kw.get("stop"), str):
        assert params.stop == [kw["stop"]]


def test_known_cases() -> None:
    """Hand-picked edges the property covers, pinned so a regression reads plainly."""
    for bad in (
        {"n": True},
        {"max_tokens": True},
        {"logprobs": True},
        {"temperature": math.inf},
        {"top_p": 10**400},
        {"repetition_penalty": math.inf},
        {"stop": 5},
        {"stop_token_ids": 7},
        {"logit_bias": [1, 2]},
        {"ignore_eos": "yes"},
        {"structured_outputs": "json"},
    ):
        try:
            SamplingParams(**bad)
        except ValueError as e:
            assert str(e).startswith(next(iter(bad))), e
        else:
            raise AssertionError(f"accepted {bad}")
    assert SamplingParams(stop="x", stop_token_ids=(3,), logit_bias={5: 1.5}).stop == ["x"]
