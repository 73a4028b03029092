"""Hybrid linear-attention models (models/qwen3_next.py) beyond parity (test_model_parity.py):
what their recurrent state changes in the engine. Prefix caching is off (a state cannot be
rebuilt from cached blocks) and a repeated prompt still matches; speculative decoding and
tensor parallelism are refused with a ValueError that says what to change; Qwen3.5's
multimodal checkpoint (its text model under ``model.language_model.``) loads."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import assert_all_blocks_free, run_to_end
from safetensors.torch import load_file, save_file
from test_model_parity import GREEDY, check_against_hf, prompts_for

from tokenmill.engine import LLMEngine
from tokenmill.modelfile import summarize


def test_a_repeated_prompt_recomputes_and_still_matches(tiny_model_dir):
    path = tiny_model_dir("qwen3_5")
    engine = LLMEngine.from_args(model=str(path), max_model_len=128, kv_cache_memory="4MiB",
                                 enable_prefix_caching=True)  # fmt: skip
    assert not engine.config.cache_config.enable_prefix_caching
    prompt = prompts_for(1, seed=5, lo=40, hi=41)[0]
    first, second = run_to_end(engine, [(prompt, GREEDY), (prompt, GREEDY)])
    assert second.metrics.num_cached_tokens == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    check_against_hf(path, prompt, second.outputs[0])
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (dict(speculative_method="ngram"), "speculative_method"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    ],
)
def test_what_the_state_cannot_do_yet_is_refused(tiny_model_dir, args, names):
    with pytest.raises(ValueError, match=names):
        LLMEngine.from_args(model=str(tiny_model_dir("qwen3_5")), kv_cache_memory="4MiB", **args)


def test_the_multimodal_checkpoint_loads_its_text_model(tiny_model_dir, tmp_path):
    """Qwen3.5's released checkpoints are Qwen3_5ForConditionalGeneration: config.json wraps the
    text config, and the language model's tensors sit under ``model.language_model.``; the
    vision tower's are skipped."""
    source = tiny_model_dir("qwen3_5")
    text = json.loads((source / "config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": text, "eos_token_id": text["eos_token_id"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(wrapped))
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(source / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = tensors["lm_head.weight"][:4].clone()
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(source / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    prompt = prompts_for(1, seed=6)[0]
    outputs = []
    for model in (source, tmp_path):
        engine = LLMEngine.from_args(model=str(model), max_model_len=128, kv_cache_memory="4MiB")
        (out,) = run_to_end(engine, [(prompt, GREEDY)])
        outputs.append(out.outputs[0].token_ids)
    assert outputs[0] == outputs[1]


def test_show_counts_kv_for_the_attention_layers_and_state_for_the_others(tiny_model_dir):
    summary = summarize(tiny_model_dir("qwen3_next"))
    # One attention layer of four: K and V of 2 heads of 16, float32.
    assert summary.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4
    # Three linear layers: a 3-input convolution over q|k|v (32 + 32 + 64 channels) and a
    # 16 x 16 state for each of 4 value heads, float32.
    assert summary.state_bytes_per_request == 3 * (128 * 3 + 4 * 16 * 16) * 4
