"""Public ways in: the offline ``LLM`` class (the server and CLI build on the engine too)."""

from tokenmill.entrypoints.llm import LLM

__all__ = ["LLM"]
