"""``tokenmill bench latency | throughput`` in process: the printed figures, --dataset, the cost
and --result-json in bench serve's schema."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.cli import latency, throughput
from tokenmill.cli import main
from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine

TINY = ["--max-model-len", "256", "--kv-cache-memory", "8MiB"]


def test_throughput_json_cost_and_result_file(tiny_model_dir, tmp_path, capsys):
    model, out = str(tiny_model_dir("llama")), tmp_path / "r.json"
    argv = ["bench", "throughput", model, *TINY, "--num-prompts", "4", "--input-len", "16",
            "--output-len", "5", "--hardware-cost-per-hour", "3.6", "--json",
            "--result-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    (run,) = json.loads(out.read_text())["runs"]
    assert run["backend"] == "tokenmill-engine" and run["model"] == model
    assert (run["completed"], run["total_output_tokens"]) == (4, 20)
    # Prompts are 16 token ids; the engine adds no BOS to token-id prompts.
    assert run["total_input_tokens"] == 64
    assert run["output_len_source"] == run["input_len_source"] == "engine"
    assert printed["output_tokens_per_s"] == pytest.approx(run["output_throughput"])
    # $3.60/h = $0.001/s: cost per million output tokens = 1000 / (tokens/s).
    expect = 1000.0 / run["output_throughput"]
    assert printed["usd_per_million_output_tokens"] == pytest.approx(expect)
    assert run["cost"]["usd_per_million_output_tokens"] == pytest.approx(expect)
    assert [len(r["chunk_times_s"]) for r in run["requests"]] == [5] * 4  # a token a step


def test_latency_with_a_jsonl_dataset(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 3}\n')
    out = tmp_path / "r.json"
    argv = ["bench", "latency", str(tiny_model_dir("llama")), *TINY, "--num-iters", "2",
            "--dataset", "jsonl", str(data), "--output-len", "6", "--result-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "ttft_s_median" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["kind"] == "latency"
    (run,) = doc["runs"]
    assert run["dataset"]["name"] == "jsonl" and run["load"]["max_concurrency"] == 1
    # --output-len overrides the line's; the text is BOS + 11 bytes under the tiny tokenizer.
    assert [(r["prompt_len"], r["output_len"]) for r in run["requests"]] == [(12, 6), (12, 6)]


def test_the_python_api(tiny_model_dir):
    engine = LLMEngine(EngineArgs(model=str(tiny_model_dir("llama")), max_model_len=256,
                                  kv_cache_memory="8MiB"))  # fmt: skip
    lat = latency(engine, input_len=16, output_len=4, num_iters=2)
    assert lat["input_len"] == 16 and lat["decode_tokens_per_s_median"] > 0
    assert lat["prefill_tokens_per_s"] == pytest.approx(16 / lat["ttft_s_median"])
    thr = throughput(engine, num_prompts=3, input_len=8, output_len=4)
    assert thr["num_prompts"] == 3
    assert thr["output_tokens_per_s"] == pytest.approx(12 / thr["elapsed_s"])
