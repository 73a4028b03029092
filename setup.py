"""Builds the optional C kernels (tokenmill/csrc: packed-weight matmul, decode-step ops,
decode-step graphs, mixture-of-experts layers);
metadata is in pyproject.

The extension is optional: where it cannot be built (no C compiler), tokenmill installs anyway
and computes with its pure-torch reference. CI sets TOKENMILL_REQUIRE_EXTENSION=1, so there a
broken build fails the install instead of passing on the slow path.
"""

import os
import sys

from setuptools import Extension, setup

compile_args = ["-O3", "-fopenmp"] if sys.platform.startswith("linux") else ["-O3"]
link_args = ["-fopenmp"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension(
            "tokenmill._qgemm",
            sources=[
                "tokenmill/csrc/qgemm.c",
                "tokenmill/csrc/decode_ops.c",
                "tokenmill/csrc/graph.c",
                "tokenmill/csrc/half.c",
                "tokenmill/csrc/moe.c",
                "tokenmill/csrc/prefill_attn.c",
                "tokenmill/csrc/relay.c",
            ],
            depends=[
                "tokenmill/csrc/simd.h",
                "tokenmill/csrc/lanes.h",
                "tokenmill/csrc/tokenmill.h",
            ],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=os.environ.get("TOKENMILL_REQUIRE_EXTENSION") != "1",
        )
    ]
)
