"""Ollama's ``keep_alive``: how long a model stays loaded after a request.

A number is seconds; a string is a Go duration ("5m", "1h30m", "90s", "0.5h") or a bare
number of seconds ("300"). 0 unloads the model as soon as the request is done; a negative
value keeps it loaded until the server stops (None here: no expiry).
"""

from __future__ import annotations

import math
import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: object) -> float | None:
    """Seconds to stay loaded (None: forever). ValueError naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration or a number of seconds; got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration(value.strip())
    else:
        raise ValueError(f"keep_alive must be a duration or a number of seconds; got {value!r}")
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number, not NaN")
    return None if seconds < 0 else seconds


def _duration(text: str) -> float:
    if re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)", text):  # a bare number of seconds
        return float(text)
    sign = -1.0 if text.startswith("-") else 1.0
    rest = text.lstrip("+-")
    total, pos = 0.0, 0
    for match in _PART.finditer(rest):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not rest or pos != len(rest):
        raise ValueError(
            f"keep_alive must be a duration such as '5m', '1h30m' or '90s', or a number of "
            f"seconds (negative: forever); got {text!r}"
        )
    return sign * total
