"""benchmarks/gpu_check.py's code path on a CPU (--smoke, a tiny model): every part reports its
figure, and greedy output agrees with the CPU's exact mode (the same float32 torch path)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def test_smoke_run_reports_every_part(tiny_model_dir, tmp_path) -> None:
    gpu_check = _load_script()
    out = tmp_path / "gpu_check.json"
    model = str(tiny_model_dir("llama"))
    argv = ["--smoke", "--device", "cpu", "--model", model, "--kernel-backend", "torch"]
    assert gpu_check.main([*argv, "--variants", "core_process", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("greedy", "decode_batch1", "prefill", "decode_step_at_batch", "throughput_4"):
        assert "error" not in result[name], result[name]
    assert result["core_process_throughput_4"]["output_tokens_per_s"] > 0
    assert result["greedy"]["passed"] and result["greedy"]["min_top1_agreement"] == 1.0
    assert result["bandwidth_bytes_per_s"] > 0 and result["matmul_flops_per_s"] > 0
    assert result["decode_batch1"]["tokens_per_s"] > 0
    assert (
        0
        < result["decode_step_at_batch"]["roofline_step_s"]
        < result["decode_step_at_batch"]["step_s"] * 100
    )
    assert result["throughput_4"]["ratio"] > 0


def test_gpu_check_sh_runs_the_8b_shape_with_fp8_weights_on_a_cpu(tmp_path) -> None:
    """benchmarks/gpu_check.sh --shape llama-8b --weights fp8 where there is no GPU: its CPU
    smoke path, with the 8B configuration cut to two layers (its head layout kept), written a
    layer a file with e4m3 weights and a scale a row, end to end (its CUDA test subset left out
    here: CI runs those tests itself)."""
    model = tmp_path / "llama-8b"
    env = {**os.environ, "SKIP_TESTS": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(SCRIPT.with_suffix(".sh")), "--synthetic", str(model), "--shape",
         "llama-8b", "--weights", "fp8", "--kernel-backend", "torch"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "running the CPU smoke path" in (tmp_path / "log.txt").read_text()
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    for name in ("greedy", "decode_batch1", "prefill", "decode_step_at_batch", "throughput_4"):
        assert "error" not in result[name], result[name]
    assert result["greedy"]["passed"] and result["decode_batch1"]["target_ratio"] == 0.8
    assert result["decode_step_at_batch"]["target_ratio"] == 1.5
    config = json.loads((model / "config.json").read_text())
    assert config["num_key_value_heads"] * 4 == config["num_attention_heads"]
    assert config["quantization_config"]["quant_method"] == "fp8"


def test_roofline_is_the_binding_resource(tiny_model_dir) -> None:
    """A decode step's roofline is bytes / bandwidth at batch 1 (weights dominate) and grows
    with the batch once FLOPs bind."""
    from tokenmill.bench.planner import model_facts

    gpu_check = _load_script()
    facts = model_facts(str(tiny_model_dir("llama")), gpu=True)
    bw, peak = 1e12, 1e12
    one = gpu_check.decode_roofline_s(facts, bw, peak, 1, 64)
    weights = facts.dense_bytes + facts.head_bytes
    assert one >= weights / bw
    many = gpu_check.decode_roofline_s(facts, bw, 1e9, 256, 64)  # a slow peak: FLOPs bind
    assert many > 256 * 2 * (facts.dense_params + facts.head_params) / 1e9 * 0.99


def test_device_idle_fraction_is_the_gaps_between_kernels() -> None:
    """Overlapping kernels (streams) count once; the gaps between busy runs are idle."""
    gpu_check = _load_script()
    assert gpu_check.device_idle_fraction([]) is None
    assert gpu_check.device_idle_fraction([(0, 10), (10, 20)]) == 0.0
    # Busy 0-10 (two overlapping kernels) and 15-20: idle 5 of 20.
    assert gpu_check.device_idle_fraction([(15, 20), (0, 6), (4, 10)]) == 0.25
    assert gpu_check.device_idle_fraction([(0, 4), (1, 2), (6, 10)]) == pytest.approx(0.2)
