"""int4 calibrated by a text (worker/calibration.py): the float model's input statistics weight
int4's rounding; bad arguments are refused before anything loads."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.layers import Linear
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.calibration import input_importance

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _args(path, tmp_path, **kwargs) -> EngineArgs:
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT)
    return EngineArgs(
        model=str(path),
        max_model_len=128,
        kv_cache_memory="4MiB",
        quantization="int4",
        int4_calibration=str(text),
        **kwargs,
    )


def test_importance_covers_every_linear_layer(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("llama")
    importance = input_importance(_args(path, tmp_path), str(tmp_path / "calibration.txt"))
    float_engine = LLMEngine(EngineArgs(model=str(path), max_model_len=128, kv_cache_memory="4MiB"))
    linears = {
        name: m
        for name, m in float_engine.executor.worker.model.checkpoint_layers()
        if isinstance(m, Linear)
    }
    assert set(importance) == set(linears)
    for name, mean_square in importance.items():
        assert mean_square.shape == (linears[name].in_features,)
        assert torch.all(mean_square >= 0) and mean_square.sum() > 0
    # q, k and v read the same normed input.
    layer = "model.layers.0.self_attn."
    torch.testing.assert_close(importance[layer + "q_proj"], importance[layer + "v_proj"])


def test_calibrated_int4_model_tracks_float(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("llama")
    engine = LLMEngine(_args(path, tmp_path, packed_activations="float32"))
    float_engine = LLMEngine(EngineArgs(model=str(path), max_model_len=128, kv_cache_memory="4MiB"))
    mlp = engine.executor.worker.model.model.layers[0].mlp
    assert mlp.gate_up_proj.groups[0].state.weight.kind == "q4"
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [[1, *range(5 + i, 25 + i)] for i in range(8)]
    for engine_ in (engine, float_engine):  # int4's pick first, float's second
        for i, prompt in enumerate(prompts):
            engine_.add_request(prompt, params, request_id=str(i))
    picks = {}
    for engine_ in (engine, float_engine):
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if out.finished:
                    picks.setdefault(out.request_id, []).append(out.outputs[0].token_ids[0])
    agree = sum(a == b for a, b in picks.values())
    assert agree >= 5, picks
    assert_all_blocks_free(engine)


def test_bad_calibration_arguments_are_refused(tiny_model_dir, tmp_path) -> None:
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="int4_calibration needs quantization='int4'"):
        EngineArgs(model=str(path), int4_calibration=__file__)
    with pytest.raises(ValueError, match="int4_calibration must be a text file"):
        EngineArgs(model=str(path), quantization="int4", int4_calibration=str(tmp_path / "no"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="the text holds no tokens"):
        LLMEngine(
            EngineArgs(
                model=str(path),
                max_model_len=128,
                kv_cache_memory="4MiB",
                quantization="int4",
                int4_calibration=str(empty),
            )
        )
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes([0xFF, 0xFE, 0x80]) * 10)
    with pytest.raises(ValueError, match="cannot read .* as UTF-8 text"):
        input_importance(_args(path, tmp_path), str(binary))
