"""JSON numbers that end: a number under a JSON format holds at most what a double carries.

A JSON schema's ``number`` (and any number of ``json_object``) is, to the grammar, digits
without end: a small model writing "1000000..." or "0.333333..." runs to ``max_tokens`` while
every token is valid. So under a JSON format a number gets at most ``max_digits`` significant
digits (17 by default: a double's round trip), at most that many leading zeros after the point,
and an exponent of at most 3 digits; past that, tokens that would add digits are refused and
the grammar's other ways on (",", "}", "e", ...) remain. A schema's own ``minimum``,
``maximum`` and ``multipleOf`` still apply: they are the grammar's. ``max_digits`` 0 turns the
bound off (``--json-number-digits 0``).

``NumberBound`` knows the vocabulary (each token's text and its run of leading digits);
``NumberState`` follows one output's text and says which tokens to refuse next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPONENT_DIGITS = 3  # a double's exponent: at most 308


@dataclass(frozen=True)
class NumberBound:
    """The limits, and the vocabulary they are checked against (built once per tokenizer)."""

    max_digits: int
    texts: tuple[str, ...]  # each token id's text
    digit_runs: tuple[tuple[int, int], ...]  # (token id, its leading digits) for digit tokens

    @classmethod
    def for_vocabulary(cls, texts: list[str], max_digits: int) -> NumberBound:
        runs = []
        for token_id, text in enumerate(texts):
            n = len(text) - len(text.lstrip("0123456789"))
            if n:
                runs.append((token_id, n))
        return cls(max_digits, tuple(texts), tuple(runs))

    def state(self) -> NumberState:
        return NumberState(self)


@dataclass
class NumberState:
    """Where an output is in the JSON text: in a string or not, and in a number, how far."""

    bound: NumberBound
    in_string: bool = False
    escaped: bool = False
    part: str = ""  # "" not in a number; "int", "frac" or "exp" of one
    significant: int = 0  # digits from the first nonzero one, integer and fraction parts
    zeros: int = 0  # leading zeros, before the first nonzero digit
    exponent: int = 0  # digits of the exponent
    _history: list[tuple[bool, bool, str, int, int, int]] = field(default_factory=list)

    def accept(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self._history.append(self._snapshot())
            if 0 <= token_id < len(self.bound.texts):
                for ch in self.bound.texts[token_id]:
                    self._step(ch)

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            snapshot = self._history.pop()
            (self.in_string, self.escaped, self.part, self.significant, self.zeros,
             self.exponent) = snapshot  # fmt: skip

    def refused(self) -> list[int]:
        """Tokens that would take the number past the bound (none outside a number)."""
        if not self.part or self.in_string:
            return []
        if self.part == "exp":
            room = EXPONENT_DIGITS - self.exponent
        else:
            limit = self.bound.max_digits
            room = limit - (self.significant if self.significant else self.zeros)
        return [token_id for token_id, digits in self.bound.digit_runs if digits > room]

    def _snapshot(self) -> tuple[bool, bool, str, int, int, int]:
        return (self.in_string, self.escaped, self.part, self.significant, self.zeros,
                self.exponent)  # fmt: skip

    def _step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return
        if ch == '"':
            self.in_string, self.part = True, ""
        elif ch.isdigit() and ch.isascii():
            if not self.part:
                self._start()
            if self.part == "exp":
                self.exponent += 1
            elif ch == "0" and not self.significant:
                self.zeros += 1
            else:
                self.significant += 1
        elif ch == "-" and not self.part:
            self._start()
        elif ch == "." and self.part == "int":
            self.part = "frac"
        elif ch in "eE" and self.part in ("int", "frac"):
            self.part = "exp"
        elif not (ch in "+-" and self.part == "exp"):  # an exponent's sign keeps it going
            self.part = ""

    def _start(self) -> None:
        self.part, self.significant, self.zeros, self.exponent = "int", 0, 0, 0
