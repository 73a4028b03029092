"""tokenmill: an LLM inference engine with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.config import EngineArgs
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.pooling import Pooling
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "Pooling", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch; importing it lazily keeps `import tokenmill.core` torch-free.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
