"""Ollama's keep_alive values: numbers of seconds, Go durations, 0 and negatives."""

from __future__ import annotations

import pytest

from tokenmill.host.keep_alive import parse_keep_alive


@pytest.mark.parametrize(
    "value, seconds",
    [(300, 300.0), (0, 0.0), (2.5, 2.5), ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0),
     ("0.5h", 1800.0), ("300", 300.0), ("0", 0.0), ("1m30.5s", 90.5), ("250ms", 0.25),
     (-1, None), ("-1", None), ("-5m", None)],
)  # fmt: skip
def test_values(value, seconds) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m5", "", "1h-5m", True, None, [1], "nan"])
def test_bad_values_name_the_accepted_forms(value) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
