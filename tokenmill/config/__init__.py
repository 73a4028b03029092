"""Frozen configuration, one module per concern:

    declare.py     option / check_declared: a setting declared once (help, choices, bounds)
    model.py       ModelConfig, the architecture every layer reads, and its parts
    checkpoint.py  config_from_hf / config_from_gguf: a checkpoint's config into ModelConfig
    cache.py       CacheConfig, the KV cache's block size, budget (parse_memory) and dtype
    engine.py      EngineArgs (what a user sets; the CLI's flags), EngineConfig,
                   SchedulerConfig and WorkerInfo (what the engine resolves with its worker)

Which model a name stands for (resolve_model, ModelSource) is resolve.py's; which architectures
exist, architectures.py's. The names below are the package's public face.
"""

from tokenmill.config.cache import (
    DEFAULT_KV_CACHE_FRACTION,
    KV_CACHE_DTYPES,
    CacheConfig,
    parse_memory,
)
from tokenmill.config.checkpoint import config_from_gguf, config_from_hf
from tokenmill.config.declare import check_declared, check_number_types, option
from tokenmill.config.engine import (
    DISTRIBUTED_EXECUTORS,
    KERNEL_BACKENDS,
    PACKED_ACTIVATIONS,
    QUANTIZATION_METHODS,
    SPECULATIVE_METHODS,
    EngineArgs,
    EngineConfig,
    SchedulerConfig,
    WorkerInfo,
)
from tokenmill.config.model import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    LinearAttentionConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    TensorParallel,
)

__all__ = [
    "DEFAULT_KV_CACHE_FRACTION",
    "DISTRIBUTED_EXECUTORS",
    "FULL_ATTENTION",
    "KERNEL_BACKENDS",
    "KV_CACHE_DTYPES",
    "LINEAR_ATTENTION",
    "PACKED_ACTIVATIONS",
    "QUANTIZATION_METHODS",
    "SLIDING_ATTENTION",
    "SPECULATIVE_METHODS",
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "LinearAttentionConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
    "SchedulerConfig",
    "TensorParallel",
    "WorkerInfo",
    "check_declared",
    "check_number_types",
    "config_from_gguf",
    "config_from_hf",
    "option",
    "parse_memory",
]
