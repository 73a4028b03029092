"""The architectures tokenmill runs: one row each, with the names checkpoints give them and the
model class that computes them. Every list of architectures is derived from ARCHITECTURES: the
config parsers' maps (config/checkpoint.py: config_from_hf / config_from_gguf), the model registry
(models/registry.py), what ``tokenmill models`` calls runnable (entrypoints/models.py).

To add an architecture: a row here; its model file under models/ (or flags of an existing
one); its checkpoint quirks, if any, in config/checkpoint.py (config_from_hf / config_from_gguf).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # ModelConfig.architecture
    model_class: str  # "module:Class", imported when a model of it loads (models/registry.py)
    hf_model_types: tuple[str, ...] = ()  # the model_type values of its config.json
    gguf_names: tuple[str, ...] = ()  # the general.architecture values of its GGUFs
    # Mixtures of experts: whether the top-k routing weights are rescaled to sum to 1 where a
    # GGUF does not say (llama.cpp fixes it per architecture, as the families' configs do).
    gguf_norm_topk: bool | None = None


# Mistral, Qwen2, Qwen3 and SmolLM3 differ from Llama only in flags ModelConfig carries (window,
# q/k/v bias, QK-norm, NoPE layers), so they share its file; the mixtures of experts share theirs.
_LLAMA = "tokenmill.models.llama:LlamaForCausalLM"
_MOE = "tokenmill.models.moe:MoeForCausalLM"
_HYBRID = "tokenmill.models.qwen3_next:Qwen3NextForCausalLM"
ARCHITECTURES = (
    Architecture(
        "gemma3",
        "tokenmill.models.gemma3:Gemma3ForCausalLM",
        ("gemma3_text", "gemma3"),
        ("gemma3",),
    ),
    # llama.cpp writes Mistral as "llama" and Mixtral as "llama" with experts (config_from_gguf).
    Architecture("llama", _LLAMA, ("llama",), ("llama",), gguf_norm_topk=True),
    Architecture("mistral", _LLAMA, ("mistral",)),
    Architecture("qwen2", _LLAMA, ("qwen2",), ("qwen2",)),
    Architecture("qwen3", _LLAMA, ("qwen3",), ("qwen3",)),
    Architecture("smollm3", _LLAMA, ("smollm3",), ("smollm3",)),
    Architecture("phi3", "tokenmill.models.phi3:Phi3ForCausalLM", ("phi3",), ("phi3",)),
    Architecture("olmo2", "tokenmill.models.olmo2:Olmo2ForCausalLM", ("olmo2",), ("olmo2",)),
    Architecture("gemma2", "tokenmill.models.gemma3:Gemma3ForCausalLM", ("gemma2",), ("gemma2",)),
    # Gemma 4's text model; a "gemma4" config.json (vision and audio too) runs its text_config.
    Architecture(
        "gemma4",
        "tokenmill.models.gemma4:Gemma4ForCausalLM",
        ("gemma4_text", "gemma4"),
        ("gemma4",),
    ),
    Architecture("mixtral", _MOE, ("mixtral",)),
    Architecture("qwen2_moe", _MOE, ("qwen2_moe",), ("qwen2moe",), gguf_norm_topk=False),
    Architecture("qwen3_moe", _MOE, ("qwen3_moe",), ("qwen3moe",), gguf_norm_topk=True),
    Architecture("olmoe", _MOE, ("olmoe",), ("olmoe",), gguf_norm_topk=False),
    # Hybrid linear attention: Gated DeltaNet layers beside gated full attention.
    Architecture("qwen3_next", _HYBRID, ("qwen3_next",), ("qwen3next",), gguf_norm_topk=True),
    Architecture("qwen3_5", _HYBRID, ("qwen3_5_text", "qwen3_5"), ("qwen35",)),
    Architecture(
        "qwen3_5_moe",
        _HYBRID,
        ("qwen3_5_moe_text", "qwen3_5_moe"),
        ("qwen35moe",),
        gguf_norm_topk=True,
    ),
    Architecture(
        "gpt_oss",
        "tokenmill.models.gpt_oss:GptOssForCausalLM",
        ("gpt_oss",),
        ("gpt-oss",),
        gguf_norm_topk=True,  # a softmax over the top k's logits
    ),
)

BY_NAME = {a.name: a for a in ARCHITECTURES}
SUPPORTED_ARCHITECTURES = tuple(BY_NAME)
# config.json model_type -> architecture
HF_MODEL_TYPES = {t: a.name for a in ARCHITECTURES for t in a.hf_model_types}
# GGUF general.architecture -> architecture
GGUF_ARCHITECTURES = {g: a.name for a in ARCHITECTURES for g in a.gguf_names}
# The hybrid ones: linear-attention layers beside full attention (models/qwen3_next.py).
HYBRID_ARCHITECTURES = tuple(a.name for a in ARCHITECTURES if a.model_class == _HYBRID)
# Every name a checkpoint may give an architecture tokenmill runs (``tokenmill models``).
CHECKPOINT_NAMES = frozenset(BY_NAME) | frozenset(HF_MODEL_TYPES) | frozenset(GGUF_ARCHITECTURES)
