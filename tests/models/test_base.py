"""CausalLM.load_weights: checkpoint names onto the model's layers (q/k/v and gate/up parts
into their fused layers), multimodal Gemma 3 names, skipped tensors, and the errors for
unexpected, missing and mis-shaped tensors."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import FusedLinear
from tokenmill.models.loader import _iter_safetensors, load_model_config
from tokenmill.models.registry import get_model_class
from tokenmill.resolve import resolve_model

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def _model_and_weights(tiny_model_dir, arch: str = "llama"):
    path = tiny_model_dir(arch)
    config = load_model_config(resolve_model(str(path)))
    model = get_model_class(config.architecture)(config, 64)
    return model, dict(_iter_safetensors(path))


def test_parts_load_into_their_fused_layers(tiny_model_dir) -> None:
    model, weights = _model_and_weights(tiny_model_dir)
    loaded = []
    model.load_weights(weights.items(), on_loaded=loaded.append)
    assert loaded == list(weights)  # reported by checkpoint name, each once
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for fused, part, name in [
        (attn.qkv_proj, "q", "self_attn.q_proj"),
        (attn.qkv_proj, "v", "self_attn.v_proj"),
        (mlp.gate_up_proj, "up", "mlp.up_proj"),
    ]:
        assert torch.equal(fused.part(part).weight, weights[f"model.layers.1.{name}.weight"])
    # Checkpoint names, not module paths: what quantization and calibration go by.
    names = {name for name, _ in model.checkpoint_layers()}
    assert {"model.layers.0.self_attn.k_proj", "model.layers.0.mlp.gate_proj"} <= names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert sum(isinstance(m, FusedLinear) for m in model.modules()) == 4


def test_multimodal_names_and_skipped_tensors(tiny_model_dir) -> None:
    """Gemma 3's multimodal checkpoints: the text model under model.language_model, vision
    tensors skipped; a tied model's lm_head.weight skipped."""
    model, weights = _model_and_weights(tiny_model_dir, "gemma3")
    renamed = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
    renamed["model.vision_tower.patch.weight"] = torch.zeros(2)
    renamed["multi_modal_projector.proj.weight"] = torch.zeros(2)
    renamed["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_weights(renamed.items())
    k = model.model.layers[0].self_attn.qkv_proj.part("k").weight
    assert torch.equal(k, weights[K_PROJ])


def test_unexpected_missing_and_mis_shaped_tensors_are_named(tiny_model_dir) -> None:
    model, weights = _model_and_weights(tiny_model_dir)
    extra = {**weights, "model.layers.0.self_attn.z_proj.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.z_proj.weight' has no place"):
        model.load_weights(extra.items())
    model, weights = _model_and_weights(tiny_model_dir)
    missing = {k: v for k, v in weights.items() if k != K_PROJ}
    with pytest.raises(ValueError, match=rf"checkpoint lacks tensors: {K_PROJ}$"):
        model.load_weights(missing.items())
    model, weights = _model_and_weights(tiny_model_dir)
    bad = {**weights, K_PROJ: weights[K_PROJ][:-1]}
    with pytest.raises(ValueError, match=rf"'{K_PROJ}' \(part 'k'\) has shape \(31, 64\)"):
        model.load_weights(bad.items())
    model, weights = _model_and_weights(tiny_model_dir)
    norm = "model.layers.0.input_layernorm.weight"
    bad = {**weights, norm: weights[norm][:-1]}
    with pytest.raises(ValueError, match=rf"'{norm}' has shape \(63,\), the model expects \(64,\)"):
        model.load_weights(bad.items())
