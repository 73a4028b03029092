"""Attention backends. The torch backend runs everywhere and is the oracle for the others."""

from tokenmill.attention.backends.torch_backend import TorchAttentionBackend

__all__ = ["TorchAttentionBackend"]
