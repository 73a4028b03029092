"""The packed matmul's int8 mode gives the same bits on every instruction set it runs on
(csrc/qgemm.c: maddubs + madd on AVX2, vpdpbusd on AVX-VNNI / AVX512-VNNI, AMX tiles from 16
rows, chosen at load).

The path is chosen once per process, so the other paths run in a subprocess with
TOKENMILL_ISA naming them, on the same inputs, and their outputs must equal this process's
exactly: every packed layout, group size and row count (tiles of 8, 4, 2 and 1 rows, several
blocks of 64 rows), "q8" and "n4" with 8-bit and with 7-bit activations (q8_unsigned).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import cpu_library as kernels
from tokenmill.quant import Int4QuantMethod
from tokenmill.quant.gguf_blocks import BLOCK_CODES, IQ4_KVALUES
from tokenmill.quant.packed import E2M1_DOUBLED, PackedWeight, pack_codes, pack_gguf

pytestmark = [
    pytest.mark.skipif(not kernels.available(), reason="C kernels not built here"),
    pytest.mark.skipif(
        kernels.isa() == "avx2",
        reason="the CPU lacks AVX512-VNNI and AVX-VNNI (or TOKENMILL_ISA=avx2): one path only",
    ),
]

ROWS = (1, 3, 17, 64, 130)
FORCED_ISAS = ("avx2", "avxvnni", "avx512vnni")  # in a subprocess; this process runs the fastest


def _gguf(ggml_type: int, n: int, k: int) -> PackedWeight:
    """Random GGUF blocks with finite, modest float16 scales, repacked."""
    elems, nbytes, _ = BLOCK_CODES[ggml_type]
    blocks = n * k // elems
    g = torch.Generator().manual_seed(ggml_type)
    data = torch.randint(0, 256, (blocks, nbytes), dtype=torch.uint8, generator=g)
    at_end = {10: [80, 82], 11: [108], 14: [208]}  # d (and dmin) after the codes
    for off in at_end.get(ggml_type, [0, 2] if ggml_type in (12, 13) else [0]):
        d = (torch.rand(blocks, generator=g) * 0.02).half()
        data[:, off : off + 2] = d.view(torch.uint8).reshape(blocks, 2)
    return pack_gguf(data.reshape(-1), ggml_type, (n, k))


def _synthetic(kind: str, group: int, n: int, k: int, f16: bool = False) -> PackedWeight:
    """Random codes over the kind's whole range ("q8": -128..127, "q4": with offsets, "n4": the
    table's 16, "u8": -32..31 stored + 32) in groups no GGUF type has (or, "u8", no GGUF type
    is kept in any longer)."""
    g = torch.Generator().manual_seed(group + k)
    low, high = {"q8": (-128, 128), "u8": (-32, 32)}.get(kind, (0, 16))
    codes = torch.randint(low, high, (n, k), generator=g)
    if kind == "n4":
        codes = torch.tensor(IQ4_KVALUES)[codes]
    elif kind == "m4":
        codes = torch.tensor(E2M1_DOUBLED)[codes]
    scales = torch.rand(n, k // group, generator=g) * 0.02
    offsets = torch.rand(n, k // group, generator=g) * 0.1 if kind == "q4" else None
    scales = scales.half() if f16 else scales
    zero = 32 if kind == "u8" else 0  # Q6_K's codes as bytes
    stored = pack_codes(codes, kind, zero)
    return PackedWeight(kind, stored, scales, offsets, group, (n, k), zero)


def _int4(group: int, n: int, k: int) -> PackedWeight:
    """A float weight quantized by --quantization int4 ("q4", offsets)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(group))
    return Int4QuantMethod(group_size=group).quantize(w, None).weight


# name -> weight [40, K]: K = 640 (blocks of 8, 8, 4 chunks), 192 (4, 2), 768 for G = 256, and
# 4608 (a tile's activations past 32 KiB: prefetched)
LAYOUTS = {
    "Q8_0 q8 f16 G32": lambda: _gguf(8, 40, 640),
    "Q4_0 q4 z8 f16 G32": lambda: _gguf(2, 40, 192),
    "Q4_0 q4 z8 f16 G32 K640": lambda: _gguf(2, 40, 640),
    "Q5_0 q5 z16 f16 G32": lambda: _gguf(6, 40, 640),
    "Q5_0 q5 z16 f16 G32 K192": lambda: _gguf(6, 40, 192),
    "Q4_K q4k G32 mins": lambda: _gguf(12, 40, 768),
    "Q4_K q4k G32 mins K4608": lambda: _gguf(12, 40, 4608),
    "Q5_K q5k G32 mins": lambda: _gguf(13, 40, 768),
    "Q5_K q5k G32 mins K4608": lambda: _gguf(13, 40, 4608),
    "Q6_K q6k z32 G16": lambda: _gguf(14, 40, 768),
    "Q6_K q6k z32 G16 K4608": lambda: _gguf(14, 40, 4608),
    "u8 z32 G16": lambda: _synthetic("u8", 16, 40, 640),
    "Q2_K q2 G16": lambda: _gguf(10, 40, 768),
    "Q2_K q2 G16 K4608": lambda: _gguf(10, 40, 4608),
    "Q3_K q3 z4 G16": lambda: _gguf(11, 40, 768),
    "Q3_K q3 z4 G16 K4608": lambda: _gguf(11, 40, 4608),
    "IQ4_NL n4 f16 G32": lambda: _gguf(20, 40, 640),
    "IQ4_XS n4k G32": lambda: _gguf(23, 40, 768),
    "IQ4_XS n4k G32 K4608": lambda: _gguf(23, 40, 4608),
    "q8 G16": lambda: _synthetic("q8", 16, 40, 640),
    "q8 f16 G64": lambda: _synthetic("q8", 64, 40, 192, f16=True),
    "q8 G128": lambda: _synthetic("q8", 128, 40, 640),
    "q8 G256 K4608": lambda: _synthetic("q8", 256, 40, 4608),
    "q4 G64 offsets": lambda: _synthetic("q4", 64, 40, 640),
    "q4 G256 offsets": lambda: _synthetic("q4", 256, 40, 768),
    "n4 f16 G64": lambda: _synthetic("n4", 64, 40, 192, f16=True),
    "m4 f16 G32": lambda: _synthetic("m4", 32, 40, 640, f16=True),  # gpt-oss's MXFP4 experts
    "m4 G32": lambda: _synthetic("m4", 32, 40, 192),
    "int4 G128": lambda: _int4(128, 40, 640),
}

# Computes the cases in a file with the kernels' qgemm; writes (its ISA, outputs).
_CHILD = """
import sys, torch
from tokenmill.kernels import cpu_library
from tokenmill.quant.packed import PackedWeight
cases = torch.load(sys.argv[1])
outs = [cpu_library.qgemm(x, PackedWeight(**w), None, True, q8_unsigned=u) for w, x, u in cases]
torch.save((cpu_library.isa(), outs), sys.argv[2])
"""


@functools.cache
def _cases() -> list[tuple[str, int, bool, PackedWeight, torch.Tensor]]:
    """(layout, rows, q8_unsigned, weight, x) for every layout and row count."""
    cases = []
    for name, build in LAYOUTS.items():
        w = build()
        assert kernels.supports(w), name
        for m in ROWS:
            x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)) * 2
            for unsigned in (False, True) if w.kind in ("q8", "n4", "m4") else (False,):
                cases.append((name, m, unsigned, w, x))
    return cases


@pytest.fixture(scope="module")
def forced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[torch.Tensor]]]:
    """Forced ISA -> (the ISA the subprocess ran, its outputs of _cases())."""
    tmp = tmp_path_factory.mktemp("isa")
    fields = ("kind", "codes", "scales", "offsets", "group", "shape", "zero")
    cases = [({f: getattr(w, f) for f in fields}, x, u) for _, _, u, w, x in _cases()]
    torch.save(cases, tmp / "cases.pt")
    results = {}
    for isa in FORCED_ISAS:
        out = tmp / f"{isa}.pt"
        env = {**os.environ, "TOKENMILL_ISA": isa}
        cwd = Path(__file__).resolve().parents[2]  # the repo root: tokenmill imports from there
        cmd = [sys.executable, "-c", _CHILD, str(tmp / "cases.pt"), str(out)]
        subprocess.run(cmd, env=env, cwd=cwd, check=True, timeout=600)
        results[isa] = torch.load(out)
    return results


@pytest.mark.parametrize("isa", FORCED_ISAS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_isa_gives_the_same_bits(layout: str, isa: str, forced) -> None:
    ours = kernels.isa()
    ran, outputs = forced[isa]
    if ran != isa:
        pytest.skip(f"this CPU does not run {isa} (TOKENMILL_ISA={isa} ran {ran})")
    if ours == isa:
        pytest.skip(f"this process runs {isa} too (TOKENMILL_ISA={isa}?): nothing to compare")
    checked = 0
    for (name, m, unsigned, w, x), theirs in zip(_cases(), outputs, strict=True):
        if name != layout:
            continue
        y = kernels.qgemm(x, w, None, act_int8=True, q8_unsigned=unsigned)
        assert y.abs().max() > 0
        diff = (y - theirs).abs().max().item()
        assert torch.equal(y, theirs), f"{ours} vs {isa}: rows {m}, unsigned {unsigned}: {diff}"
        checked += 1
    assert checked >= len(ROWS)


def _isa_with(value: str | None) -> str:
    """kernels.isa() in a fresh process with TOKENMILL_ISA=value (unset for None)."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_ISA"}
    if value is not None:
        env["TOKENMILL_ISA"] = value
    code = "from tokenmill.kernels import cpu_library; print(cpu_library.isa())"
    cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_tokenmill_isa_forces_avx2_and_ignores_names_the_cpu_does_not_run(forced) -> None:
    fastest = _isa_with(None)
    assert fastest in ("avxvnni", "avx512vnni", "amx")  # a VNNI CPU (pytestmark)
    assert forced["avx2"][0] == "avx2"
    assert _isa_with("no-such-isa") == fastest
