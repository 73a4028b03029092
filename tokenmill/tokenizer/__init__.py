"""Tokenizers: GGUF or Hugging Face files to a fast `Tokenizer`, plus chat templates."""

from __future__ import annotations

from tokenmill.tokenizer.base import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
