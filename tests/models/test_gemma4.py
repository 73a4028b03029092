"""Gemma 4's checkpoint reading: its per-layer shapes, KV-sharing layers that keep no cache, and
a multimodal ("gemma4") checkpoint whose language model runs alone. Parity with transformers is
tests/models/test_model_parity.py's (gemma4, gemma4_ple, gemma4_moe)."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from tokenmill.engine import LLMEngine
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams


def test_config_reads_global_shapes_and_kv_sharing(tiny_model_dir):
    dense = load_model_config(resolve_model(str(tiny_model_dir("gemma4"))))
    assert dense.architecture == "gemma4" and dense.attention_k_eq_v
    assert [dense.layer_head_dim(i) for i in range(6)] == [16, 16, 32] * 2
    assert [dense.layer_num_kv_heads(i) for i in range(6)] == [2, 2, 1] * 2
    assert dense.rope_scaling.rope_type == "proportional"
    assert dense.rope_scaling.partial_rotary_factor == 0.25
    ple = load_model_config(resolve_model(str(tiny_model_dir("gemma4_ple"))))
    # Layers 4 (window) and 5 (global) attend with layers 3's and 2's K/V and keep none.
    assert ple.kv_source_layers == (0, 1, 2, 3, 3, 2)
    assert ple.kv_layers == (0, 1, 2, 3) and ple.double_wide_mlp
    assert ple.hidden_size_per_layer_input == 8 and ple.num_global_key_value_heads is None


def test_a_multimodal_checkpoint_runs_its_language_model(tiny_model_dir, tmp_path):
    """A "gemma4" config.json with the text model under text_config and its tensors under
    model.language_model., beside a vision tower's: the same greedy output as the text model."""
    src = tiny_model_dir("gemma4")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, tmp_path / name)
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "gemma4", "text_config": text, "eos_token_id": text["eos_token_id"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "model.language_model.", 1): t
        for name, t in load_file(src / "model.safetensors").items()
    }
    tensors["model.vision_tower.patch_embedder.weight"] = torch.zeros(4, 4)
    tensors["model.embed_vision.embedding_projection.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = []
    for path in (src, tmp_path):
        engine = LLMEngine.from_args(model=str(path), max_model_len=64, kv_cache_memory="2MiB")
        rid = engine.add_request([1, 5, 9, 14, 20], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    outputs.append(out.outputs[0].token_ids)
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]
