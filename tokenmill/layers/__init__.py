"""Building blocks shared by the model files: linear, norms, rotary embeddings, activations."""

from tokenmill.layers.activation import ActAndMul, get_act_fn
from tokenmill.layers.embedding import Embedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

__all__ = [
    "ActAndMul",
    "Embedding",
    "GemmaRMSNorm",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "get_act_fn",
]
