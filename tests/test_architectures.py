"""One row per architecture (tokenmill/architectures.py): every other list is derived from it,
and every row names a model class that loads."""

from __future__ import annotations

import pytest

from tokenmill.architectures import (
    ARCHITECTURES,
    CHECKPOINT_NAMES,
    GGUF_ARCHITECTURES,
    HF_MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
)
from tokenmill.config import config_from_gguf, config_from_hf
from tokenmill.models.base import CausalLM
from tokenmill.models.registry import get_model_class


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_every_row_names_a_model_class(arch) -> None:
    assert issubclass(get_model_class(arch.name), CausalLM)
    assert all(HF_MODEL_TYPES[t] == arch.name for t in arch.hf_model_types)
    assert all(GGUF_ARCHITECTURES[g] == arch.name for g in arch.gguf_names)


def test_the_derived_lists() -> None:
    assert SUPPORTED_ARCHITECTURES[:2] == ("gemma3", "llama")
    assert (
        HF_MODEL_TYPES["gemma3_text"] == "gemma3" and GGUF_ARCHITECTURES["qwen3moe"] == "qwen3_moe"
    )
    assert {"qwen2moe", "gemma3_text", "mixtral"} <= CHECKPOINT_NAMES
    with pytest.raises(ValueError, match="supported: gemma3, llama"):
        get_model_class("mamba")


def test_an_unknown_checkpoint_architecture_names_the_supported_ones(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match="'mamba'.*supported: gemma3, llama, mistral"):
        config_from_hf(tmp_path)
    with pytest.raises(ValueError, match="'mamba' is not supported; supported: gemma3, llama"):
        config_from_gguf(tmp_path / "m.gguf", {"general.architecture": "mamba"}, set())
