"""The C kernels' interface, read from the one header that declares it (csrc/tokenmill.h): the
ctypes signature of every exported function, from its prototype; the packed weight layouts;
the ops of a recorded decode step; the constants both sides share. Nothing here is written a
second time: a function, layout or constant added to the header is here with no edit.

The header is plain C with one declaration a line or statement, so a few regular expressions
read it; ``functions`` refuses a type it does not know rather than guess a signature.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "tokenmill.h"

# C scalar types of the prototypes -> ctypes (every pointer is a c_void_p: tensors' addresses)
_SCALARS = {
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


@dataclass(frozen=True, slots=True)
class Layout:
    """A row of the header's TM_LAYOUTS: a packed weight layout and its traits."""

    code: int  # its value of enum tm_layout: the low bits of a weight's `kind` argument
    kind: str  # quant/packed.py's kind ("" for the kernel's own forms, never stored)
    block_bytes: int  # the k-quants: bytes of a stored 256-element super-block, else 0
    scales_at: int  # where its sub-block scale bytes start
    group: int  # the k-quants: elements a sub-block
    ds: int  # the k-quants: float16 scales a super-block (d, and dmin: 2)
    is_signed: bool  # int8 codes (else unsigned with a zero point)


@functools.cache
def _text() -> str:
    """The header without its comments."""
    text = HEADER.read_text()
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def _ctype(decl: str) -> type | None:
    """A parameter's or return's C type (with or without a name) -> its ctypes type."""
    decl = decl.strip()
    if "*" in decl:
        return ctypes.c_char_p if re.fullmatch(r"const char\s*\*\s*\w*", decl) else ctypes.c_void_p
    words = decl.replace("const ", "").split()
    if words == ["void"]:
        return None
    if not words or words[0] not in _SCALARS:
        raise ValueError(f"tokenmill.h: no ctypes type for {decl!r}")
    return _SCALARS[words[0]]


@functools.cache
def functions() -> dict[str, tuple[type | None, list[type]]]:
    """Every tm_* prototype of the header: name -> (restype, argtypes)."""
    found = {}
    for ret, name, params in re.findall(r"([\w ]+?\**)\s*(tm_\w+)\s*\(([^)]*)\)\s*;", _text()):
        args = [] if params.strip() in ("", "void") else params.split(",")
        found[name] = (_ctype(ret), [_ctype(a) for a in args])
    return found


def bind(lib: ctypes.CDLL, names: list[str] | None = None) -> None:
    """Declare the functions ``names`` (all of the header's by default) on ``lib`` with their
    signatures."""
    for name, (restype, argtypes) in functions().items():
        if names is None or name in names:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype


@functools.cache
def enum(name: str) -> dict[str, int]:
    """The members of ``enum name { ... }`` with their values, as C numbers them."""
    match = re.search(rf"enum\s+{name}\s*\{{([^}}]*)\}}", _text())
    if match is None:
        raise KeyError(f"tokenmill.h declares no enum {name}")
    values, value = {}, -1
    for item in filter(None, (part.strip() for part in match.group(1).split(","))):
        member, _, given = item.partition("=")
        value = int(given, 0) if given.strip() else value + 1
        values[member.strip()] = value
    return values


@functools.cache
def define(name: str) -> int:
    """The integer a ``#define name N`` gives."""
    match = re.search(rf"#define\s+{name}\s+(-?\w+)\s*$", _text(), flags=re.M)
    if match is None:
        raise KeyError(f"tokenmill.h defines no {name}")
    return int(match.group(1), 0)


@functools.cache
def layouts() -> dict[str, Layout]:
    """The stored layouts of TM_LAYOUTS by kind (quant/packed.py's names)."""
    row = r"X\(TM_\w+,\s*\"(\w*)\",\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d)\)"
    found = {}
    # enum tm_layout numbers the rows in order (the X macro makes its members)
    for code, (kind, *traits) in enumerate(re.findall(row, _text())):
        block_bytes, scales_at, group, ds, is_signed = (int(t) for t in traits)
        if kind:
            found[kind] = Layout(code, kind, block_bytes, scales_at, group, ds, bool(is_signed))
    return found


def kind_code(kind: str, f16_scales: bool, zero: int) -> int:
    """A weight's `kind` argument (TM_KIND_LAYOUT, TM_KIND_F16, TM_KIND_ZERO)."""
    return layouts()[kind].code | (64 if f16_scales else 0) | zero << 8
