"""Architecture name -> model class, imported lazily so only the needed file loads."""

from __future__ import annotations

import importlib

from tokenmill.models.base import CausalLM

# Mistral, Qwen2 and Qwen3 differ from Llama only in flags ModelConfig carries (window, q/k/v
# bias, QK-norm), so they share its file.
_MODELS: dict[str, tuple[str, str]] = {
    "gemma3": ("tokenmill.models.gemma3", "Gemma3ForCausalLM"),
    "llama": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "mistral": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "qwen2": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "qwen3": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "mixtral": ("tokenmill.models.moe", "MoeForCausalLM"),
    "qwen2_moe": ("tokenmill.models.moe", "MoeForCausalLM"),
    "qwen3_moe": ("tokenmill.models.moe", "MoeForCausalLM"),
    "olmoe": ("tokenmill.models.moe", "MoeForCausalLM"),
}


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(_MODELS)}"
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
