"""The C kernels' one interface (csrc/tokenmill.h): Python binds every exported function from
its prototype there, takes the weight layouts and the recorded ops from it, and stops a load
where quant/packed.py's layouts disagree with it."""

from __future__ import annotations

import ctypes
import re

import pytest

from tokenmill.kernels import abi
from tokenmill.kernels import cpu_library as kernels
from tokenmill.kernels.recording import OP_HALF_ROWS, OP_NAMES, OP_QGEMM, OP_WIDTH
from tokenmill.quant import packed

CSRC = abi.HEADER.parent
# A non-static function defined at the start of a line: what the extension exports.
DEFINITION = re.compile(r"^(?!static)(?:TM_TARGET\w* )?\w[\w ]*?\**\s*(tm_\w+)\(", re.M)


def test_every_exported_function_is_declared_in_the_header() -> None:
    """Each C file includes the header (so the compiler holds its definitions to the
    prototypes), and the functions they define are the header's, no more, no fewer."""
    defined = set()
    for source in sorted(CSRC.glob("*.c")):
        text = source.read_text()
        assert '#include "tokenmill.h"' in text, source.name
        defined |= set(DEFINITION.findall(text))
    assert defined == set(abi.functions())


def test_signatures_come_from_the_prototypes() -> None:
    restype, argtypes = abi.functions()["tm_qgemm"]
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    assert restype is c_int
    assert argtypes == [i64, i64, i64, ptr, c_int, ptr, ptr, ptr, i64, ptr, ptr, c_int]
    assert abi.functions()["tm_qgemm_isa"] == (ctypes.c_char_p, [])
    assert abi.functions()["tm_add"][0] is None  # void
    assert ctypes.c_float in abi.functions()["tm_rmsnorm"][1]


@pytest.mark.skipif(not kernels.available(), reason="C kernels not built here")
def test_the_library_binds_every_function() -> None:
    lib = kernels.library()
    for name, (restype, argtypes) in abi.functions().items():
        fn = getattr(lib, name)
        assert (fn.restype, fn.argtypes) == (restype, argtypes), name


def test_constants_and_ops_come_from_the_header() -> None:
    assert kernels.ACTIVATIONS == {"gelu_tanh": 0, "silu": 1}
    assert kernels.MAX_ATTENTION_GROUP == 16 and kernels.MOE_MAX_EXPERTS == 1024
    assert (OP_QGEMM, OP_HALF_ROWS, OP_WIDTH) == (1, 14, 20)
    assert set(OP_NAMES) == set(range(1, 15))


def test_the_layouts_agree_with_quant_packed() -> None:
    """Every kind the packed matmul computes is a row of TM_LAYOUTS with the same super-block
    geometry; a kind's `kind` argument is its row's code with the float16 bit and zero point."""
    kernels.check_layouts()
    layouts = abi.layouts()
    assert set(layouts) == set(packed.PACKED_KINDS)
    assert len({layout.code for layout in layouts.values()}) == len(layouts)
    q6k = layouts["q6k"]
    assert (q6k.block_bytes, q6k.scales_at, q6k.group, q6k.ds) == (208, 192, 16, 1)
    assert abi.kind_code("q6k", True, 32) == q6k.code | 64 | 32 << 8


def test_a_disagreement_stops_the_load(monkeypatch) -> None:
    """A super-block size written differently on the two sides would have the kernels read
    the weights' bytes wrong: it is refused, naming the kind."""
    wrong = dict(packed.K_QUANT_KINDS) | {"q4k": (144, 128)}
    monkeypatch.setattr(packed, "K_QUANT_KINDS", wrong)
    with pytest.raises(RuntimeError, match="q4k"):
        kernels.check_layouts()
    monkeypatch.setattr(packed, "PACKED_KINDS", (*packed.PACKED_KINDS, "q7"))
    with pytest.raises(RuntimeError, match="q7"):
        kernels.check_layouts()
