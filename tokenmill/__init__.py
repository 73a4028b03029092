"""tokenmill: an LLM inference engine with a paged KV cache and continuous batching."""

from tokenmill.config import EngineArgs
from tokenmill.entrypoints.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
