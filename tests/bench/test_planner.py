"""The roofline planner's arithmetic, on model facts read from real files and a made-up machine
whose rates make every term easy to compute by hand."""

from __future__ import annotations

import math

import pytest

from tokenmill.bench.hardware import HARDWARE_PRESETS, Hardware, hardware_named
from tokenmill.bench.planner import (
    Workload,
    decode_step,
    model_facts,
    plan,
    prefill_steps,
)

# 1 GB/s, 1 GOP/s of matmul at any size, 1 GFLOP/s attention: a term's seconds = its G-units.
UNIT = Hardware(
    name="unit",
    bandwidth_bytes_per_s=1e9,
    matmul_ops_per_s={1: 1e9},
    decode_attention_flops=1e9,
    prefill_attention_flops=1e9,
    memory_bytes=10**12,
    price_per_hour=3.6,
    step_overhead_s=1e-3,
    request_overhead_s=1e-4,
)
H, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 384


def test_facts_of_a_float_llama_count_its_matmuls_and_kv_bytes(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("llama")))
    per_layer = H * HEADS * HEAD_DIM * 2 + H * KV_HEADS * HEAD_DIM * 2 + 3 * H * FFN
    assert m.dense_params == LAYERS * per_layer
    assert m.dense_bytes == 4 * m.dense_params  # float32 on a CPU
    assert (m.head_params, m.embedding_bytes) == (VOCAB * H, 4 * VOCAB * H)  # untied
    assert m.kv_bytes_per_token == 2 * KV_HEADS * HEAD_DIM * 4
    assert m.layer_windows == (None, None)
    on_gpu = model_facts(str(tiny_model_dir("llama")), gpu=True, kv_cache_dtype="int8")
    assert on_gpu.dense_bytes == 2 * m.dense_params  # bfloat16
    assert on_gpu.kv_bytes_per_token == 2 * KV_HEADS * HEAD_DIM * (1 + 4 / HEAD_DIM)


def test_a_tied_head_is_read_once_and_windows_cut_kv_reads(tiny_model_dir) -> None:
    qwen = model_facts(str(tiny_model_dir("qwen2")))
    assert qwen.embedding_bytes == 0 and qwen.head_params == VOCAB * H
    gemma = model_facts(str(tiny_model_dir("gemma3")))  # 6 layers, every 6th global, window 24
    assert gemma.layer_windows == (24,) * 5 + (None,)
    assert gemma.kv_tokens_read(100) == 5 * 24 + 100
    assert gemma.kv_tokens_read(10) == 6 * 10


def test_the_embedded_gguf_reads_its_packed_bytes() -> None:
    m = model_facts("gemma-3-270m")
    assert m.num_layers == 18 and m.head_dim == 256 and m.num_kv_heads == 1
    # Q8_0 tied embedding as the head: 262144 x 640 weights at 1 + 2/32 bytes each.
    assert m.head_params == 262144 * 640
    assert m.head_bytes == int(262144 * 640 * (1 + 2 / 32))
    assert m.embedding_bytes == 0
    assert 0.24e9 < m.weight_bytes < 0.26e9  # the file's 246.6 MB of tensors
    assert model_facts("gemma-3-270m", quantization="int8").dense_bytes == m.dense_params


def test_experts_touched_grow_with_tokens_up_to_all_experts(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("mixtral")))
    assert (m.num_experts, m.top_k) == (8, 2)
    assert m.expert_params == LAYERS * 3 * H * 64
    assert m.experts_touched(1) == pytest.approx(2.0)
    assert m.experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert m.experts_touched(10_000) == pytest.approx(8.0)
    step = decode_step(m, UNIT, batch=1, context_len=1)
    assert step.weight_read * 1e9 == pytest.approx(
        m.dense_bytes + m.head_bytes + 2 * m.expert_bytes
    )


def test_decode_step_terms_by_hand(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("llama")))
    step = decode_step(m, UNIT, batch=4, context_len=100)
    assert step.weight_read == pytest.approx((m.dense_bytes + m.head_bytes) / 1e9)
    assert step.linear_compute == pytest.approx(2 * 4 * (m.dense_params + m.head_params) / 1e9)
    assert step.kv_read == pytest.approx(4 * LAYERS * 100 * m.kv_bytes_per_token / 1e9)
    assert step.attention_compute == pytest.approx(4 * 4 * HEADS * HEAD_DIM * LAYERS * 100 / 1e9)
    assert step.host == pytest.approx(1e-3 + 4e-4)
    # Elementwise ops: 12 passes of the hidden state and 3 of the MLP width, float32, a layer.
    assert m.activation_bytes_per_token == LAYERS * 4 * (12 * H + 3 * FFN)
    assert step.activation_read == pytest.approx(4 * m.activation_bytes_per_token / 1e9)
    expected = (
        max(step.weight_read, step.linear_compute)
        + max(step.kv_read, step.attention_compute)
        + step.activation_read
        + step.host
    )
    assert step.total == pytest.approx(expected)
    # A tiny model's step is all host work; make host free and weights heavy to flip it.
    heavy = Hardware(**{**_fields(UNIT), "step_overhead_s": 0.0, "request_overhead_s": 0.0,
                        "bandwidth_bytes_per_s": 1e3})  # fmt: skip
    assert decode_step(m, heavy, 1, 1).binding == "bandwidth (weight reads)"
    assert step.binding == "host (scheduling, sampling)"


def _fields(hw: Hardware) -> dict:
    return {f: getattr(hw, f) for f in Hardware.__slots__}


def test_chunked_prefill_schedules_prompts_in_order_within_the_budget(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("llama")))
    steps = prefill_steps(m, UNIT, num_prompts=3, prompt_len=1000, token_budget=2048)
    assert [finished for _, finished in steps] == [2, 1]
    # The second step holds the third prompt's last 952 tokens, from position 48.
    second = steps[1][0]
    keys = LAYERS * sum(range(49, 1001))
    assert second.attention_compute == pytest.approx(4 * HEADS * HEAD_DIM * keys / 1e9)
    params = m.dense_params
    assert second.linear_compute == pytest.approx((2 * 952 * params + 2 * m.head_params) / 1e9)


def test_plan_fits_requests_in_the_kv_budget_and_prices_the_throughput(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("llama")))
    per_seq = (64 + 32) * LAYERS * m.kv_bytes_per_token
    w = Workload(prompt_len=64, output_len=32, kv_cache_bytes=int(per_seq * 10.5))
    p = plan(m, UNIT, w)
    assert p.max_concurrency == 10
    assert [pt.concurrency for pt in p.points] == [1, 2, 4, 8, 10]
    one = p.points[0]
    assert one.output_tokens_per_s == pytest.approx(32 / (one.prefill_s + one.decode_s))
    # $3.60 an hour is $1 per million tokens at 1,000 tokens/s.
    assert one.cost_per_million_output == pytest.approx(1000 / one.output_tokens_per_s)
    assert p.points[-1].output_tokens_per_s > one.output_tokens_per_s
    assert one.tokens_per_s_per_user == pytest.approx(1 / one.decode_step.total)


def test_a_request_rate_settles_where_littles_law_holds(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("llama")))
    p = plan(m, UNIT, Workload(prompt_len=64, output_len=32, request_rate=20.0, max_num_seqs=64))
    r = p.rate
    assert r is not None and r.point is not None
    assert r.concurrency == pytest.approx(20.0 * r.point.response_time_s)
    assert r.concurrency <= r.point.concurrency
    flood = plan(m, UNIT, Workload(prompt_len=64, output_len=32, request_rate=1e6))
    assert flood.rate.point is None and math.isinf(flood.rate.concurrency)
    assert flood.rate.max_request_rate < 1e6


def test_plans_that_cannot_run_say_why(tiny_model_dir) -> None:
    m = model_facts(str(tiny_model_dir("llama")))
    small = Hardware(**{**_fields(UNIT), "memory_bytes": 1000})
    with pytest.raises(ValueError, match="needs .* GB for its weights"):
        plan(m, small, Workload())
    with pytest.raises(ValueError, match="exceeds .* context of 512"):
        plan(m, UNIT, Workload(prompt_len=500, output_len=100))
    with pytest.raises(ValueError, match="KV cache"):
        plan(m, UNIT, Workload(prompt_len=64, output_len=32, kv_cache_bytes=10))
    with pytest.raises(ValueError, match="prompt-len"):
        Workload(prompt_len=0)
    with pytest.raises(ValueError, match="--hardware must be one of h200, h100"):
        hardware_named("tpu")


def test_presets_are_datasheets_with_their_assumptions_stated() -> None:
    h100 = HARDWARE_PRESETS["h100"]
    assert h100.bandwidth_bytes_per_s == pytest.approx(3.35e12 * 0.8)
    assert h100.memory_bytes == 80 * 10**9
    assert any("assumed 80% of bandwidth" in note for note in h100.notes)
    # A GPU serves gemma-3-270m far faster than the made-up machine, and bandwidth-bound
    # terms shrink with the datasheet's bandwidth.
    m = model_facts("gemma-3-270m", gpu=True)
    fast = decode_step(m, hardware_named("h200"), 1, 512).weight_read
    slow = decode_step(m, hardware_named("l4"), 1, 512).weight_read
    assert slow / fast == pytest.approx(4.8 / 0.3)


def test_each_matmul_kind_runs_at_its_own_kernels_rate() -> None:
    from tokenmill.bench.planner import linear_seconds

    m = model_facts("gemma-3-270m")
    assert m.head_kind == "Q8_0@640"
    assert sum(m.dense_params_by_kind.values()) == m.dense_params
    types = {kind.split("@")[0] for kind in m.dense_params_by_kind}
    inputs = {int(kind.split("@")[1]) for kind in m.dense_params_by_kind}
    assert types <= {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} and inputs == {640, 1024, 2048}
    kinds = [*m.dense_params_by_kind, m.head_kind]
    rates = {kind: {1: 1e9 * (i + 1)} for i, kind in enumerate(kinds)}
    hw = Hardware(**{**_fields(UNIT), "matmul_ops_by_kind": rates})
    expected = sum(2 * 8 * n / rates[kind][1] for kind, n in m.dense_params_by_kind.items())
    expected += 2 * 1 * m.head_params / rates[m.head_kind][1]
    assert linear_seconds(m, hw, rows=8, head_rows=1) == pytest.approx(expected)
    as_int4 = model_facts("gemma-3-270m", quantization="int4")
    assert {kind.split("@")[0] for kind in as_int4.dense_params_by_kind} == {"int4"}
    assert as_int4.head_kind == "int4@640"
