"""Building blocks shared by the model files: linear, norms, rotary embeddings, activations."""

from tokenmill.layers.activation import ActAndMul, get_act_fn
from tokenmill.layers.embedding import Embedding
from tokenmill.layers.linear import FusedLinear, Linear, MergedLinear, QKVLinear
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

__all__ = [
    "ActAndMul",
    "Embedding",
    "FusedLinear",
    "GemmaRMSNorm",
    "Linear",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "get_act_fn",
]
