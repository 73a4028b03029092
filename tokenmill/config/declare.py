"""Settings declared once: ``option`` makes a dataclass field that carries its flag's help,
its choices and its bounds (cli.add_declared_flags makes the flags from them), and
``check_declared`` / ``check_number_types`` hold a value to its declaration with a ValueError
naming the field."""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    metavar: str | None = None,
    choices_text: str | None = None,
    flag: str | None = None,
) -> Any:
    """A field of a settings dataclass (EngineArgs, server.config.ServerConfig), declared
    once: its default, the help of its CLI flag (cli.py makes the flag from this: ``flag``,
    else --the-field-name; the help says the default unless it says "(default: ...)"), and the
    values it takes, which ``check_declared`` holds it to (a ValueError naming the field) and
    the flag offers: ``choices`` (``choices_text`` says them in the error, else "one of ..."),
    or bounds ``low`` / ``high``. None passes where the field's type allows it."""
    meta = {"help": help, "choices": choices, "low": low, "high": high, "metavar": metavar}
    return field(default=default, metadata=meta | {"choices_text": choices_text, "flag": flag})


def check_declared(settings: Any) -> None:
    """ValueError for a value of ``settings`` outside its field's declared choices or bounds
    (``option``)."""
    for f in fields(settings):
        value, meta = getattr(settings, f.name), f.metadata
        choices, low, high = meta.get("choices"), meta.get("low"), meta.get("high")
        if value is None and "None" in str(f.type):
            continue
        if choices is not None and value not in choices:
            what = meta["choices_text"] or "one of " + ", ".join(str(c) for c in choices)
            unset = " (or unset)" if "None" in str(f.type) else ""
            raise ValueError(f"{f.name} must be {what}{unset}; got {value!r}")
        if low is not None and high is not None and not low <= value <= high:
            raise ValueError(f"{f.name} must be in [{low}, {high}]; got {value}")
        if low is not None and high is None and value < low:
            raise ValueError(f"{f.name} must be >= {low}; got {value}")


# Number and flag annotations -> (the types they take, how an error names them).
_NUMBER_FIELDS = {
    "int": ((int,), "an integer"),
    "int | None": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "True or False"),
}


def check_number_types(settings: Any) -> None:
    """ValueError for an integer, float or flag field given another type (LLM(max_model_len=
    "4096") would otherwise fail later as a TypeError, or a flag given "no" count as set)."""
    for f in fields(settings):
        kind, value = _NUMBER_FIELDS.get(str(f.type)), getattr(settings, f.name)
        if kind is None or (value is None and f.type == "int | None"):
            continue
        allowed, what = kind
        # bool is an int subclass: True is no integer here
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ValueError(f"{f.name} must be {what}; got {value!r}")
