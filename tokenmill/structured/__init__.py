"""Structured outputs: formats compiled to grammar matchers (compiler.py, no torch: the engine
compiles) and token bitmasks from them (bitmask.py: the worker applies them)."""

from __future__ import annotations

from tokenmill.structured.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    GrammarSource,
)

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "GrammarSource"]
