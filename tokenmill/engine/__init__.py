"""The engine: request intake, the step loop, detokenization and output assembly."""

from tokenmill.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
