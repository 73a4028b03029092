"""The memory plan (worker/memory.py): the KV cache's budget from an explicit kv_cache_memory, a
share of free memory on CPU, or gpu_memory_utilization of a CUDA device after the weights and
a profiling step; and the profiling step itself, run on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.config import DEFAULT_KV_CACHE_FRACTION, CacheConfig, EngineArgs
from tokenmill.core.sched_output import NewRequestData, SchedulerOutput
from tokenmill.kernels import cpu_library
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.memory import dummy_prefill, plan
from tokenmill.worker.worker import Worker, resolve_worker_config

GiB = 2**30
PER_BLOCK = 2**20  # 1 MiB a block


def test_explicit_bytes_override_everything():
    p = plan(PER_BLOCK, 5 * GiB, 10 * PER_BLOCK + 7, free_bytes=GiB, total_bytes=80 * GiB)
    assert (p.basis, p.kv_cache_bytes, p.num_kv_blocks) == (
        "kv_cache_memory",
        10 * PER_BLOCK + 7,
        10,
    )
    assert p.activation_peak_bytes is None


def test_fraction_of_free_memory_on_any_device():
    p = plan(PER_BLOCK, GiB, 0.5, free_bytes=GiB, total_bytes=80 * GiB)
    assert (p.basis, p.kv_cache_bytes, p.num_kv_blocks) == ("fraction", GiB // 2, 512)


def test_unset_on_cpu_is_the_default_fraction():
    p = plan(PER_BLOCK, GiB, None, free_bytes=10 * GiB)
    assert p.basis == "fraction" and p.fraction == DEFAULT_KV_CACHE_FRACTION
    assert p.num_kv_blocks == int(10 * GiB * DEFAULT_KV_CACHE_FRACTION) // PER_BLOCK


def test_unset_on_cuda_is_what_utilization_leaves():
    # 80 GiB * 0.9 = 72 GiB; 20 GiB in use after loading; a 3 GiB activation peak: 49 GiB left.
    p = plan(
        PER_BLOCK,
        16 * GiB,
        None,
        free_bytes=60 * GiB,
        total_bytes=80 * GiB,
        utilization=0.9,
        in_use_bytes=20 * GiB,
        activation_peak_bytes=3 * GiB,
    )
    assert p.basis == "gpu_memory_utilization"
    assert p.kv_cache_bytes == int(80 * GiB * 0.9) - 23 * GiB
    assert p.num_kv_blocks == p.kv_cache_bytes // PER_BLOCK
    line = p.describe()
    for part in ("weights 16.0 GiB", "activations peak 3.0 GiB", f"{p.num_kv_blocks} blocks",
                 "gpu_memory_utilization 0.9 of 80.0 GiB", "20.0 GiB in use"):  # fmt: skip
        assert part in line, line


def test_too_little_left_names_the_knobs():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization.*kv_cache_memory"):
        plan(PER_BLOCK, GiB, None, free_bytes=GiB, total_bytes=10 * GiB, utilization=0.5,
             in_use_bytes=4 * GiB, activation_peak_bytes=GiB)  # fmt: skip
    with pytest.raises(ValueError, match="fewer than 2 KV blocks.*raise kv_cache_memory"):
        plan(PER_BLOCK, GiB, PER_BLOCK, free_bytes=GiB)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, 2])
def test_utilization_must_be_a_share(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=bad)
    EngineArgs(gpu_memory_utilization=1.0)


def test_bad_kv_cache_memory_fails_at_the_arguments():
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineArgs(kv_cache_memory="lots")


def test_profiling_step_runs_the_model_in_sequences_of_max_model_len(tiny_model_dir):
    """40 tokens at max_model_len 16 are sequences of 16, 16 and 8 tokens, each from position 0:
    the last rows' log-probs are those of positions 6 and 7 of one 8-token sequence (every
    token id 0), which a real prefill of eight zeros gives too."""
    args = EngineArgs(model=str(tiny_model_dir("llama")), device="cpu", max_model_len=64,
                      kv_cache_memory="4MiB", enforce_eager=True)  # fmt: skip
    worker = Worker(resolve_worker_config(args))
    cache = CacheConfig(block_size=16)
    model, dtype, device = worker.model, worker.dtype, worker.device
    split = dummy_prefill(model, cache, dtype, device, 40, 16, 2)()
    alone = dummy_prefill(model, cache, dtype, device, 8, 16, 2)()
    assert split.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(split, alone, rtol=0, atol=1e-5)
    worker.initialize(CacheConfig(block_size=16, num_blocks=8))
    assert worker.runner is not None
    params = SamplingParams(temperature=0.0, max_tokens=1)
    new = NewRequestData("r", [0] * 9, 9, params, [[1]], 0)
    runner = worker.runner
    sched = SchedulerOutput([new], [], {"r": 8})  # positions 0..7 of the nine zeros
    runner.update_states(sched)
    step = runner.prepare_step(sched)
    hidden = runner.forward(step)
    logits = model.compute_logits(hidden[6:8]).float().log_softmax(dim=-1)
    torch.testing.assert_close(split, logits, rtol=0, atol=1e-5)


def test_cpu_worker_logs_its_plan(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.worker.worker"):
        args = EngineArgs(model=str(tiny_model_dir("llama")), device="cpu", max_model_len=64,
                          kv_cache_memory="4MiB", enforce_eager=True)  # fmt: skip
        worker = Worker(resolve_worker_config(args))
    plan_lines = [r.getMessage() for r in caplog.records if "memory plan" in r.getMessage()]
    assert len(plan_lines) == 1
    assert f"{worker.info.num_kv_blocks} blocks" in plan_lines[0]
    assert worker.info.num_kv_blocks == 4 * 2**20 // worker.info.kv_bytes_per_block


def test_cpu_plan_names_every_term_and_their_sum():
    MiB = 2**20
    p = plan(PER_BLOCK, 300 * MiB, 10 * PER_BLOCK, free_bytes=GiB, runtime_bytes=200 * MiB,
             buffer_bytes=5 * MiB)  # fmt: skip
    line = p.describe()
    for part in ("runtime 200.0 MiB", "weights 300.0 MiB", "step buffers 5.0 MiB",
                 "KV cache 10.0 MiB = 10 blocks", "515.0 MiB in all"):  # fmt: skip
        assert part in line, line
    assert p.total_bytes_planned == 515 * MiB


@pytest.mark.skipif(not cpu_library.available(), reason="decode graphs need the C kernels")
@pytest.mark.parametrize(
    ("max_num_seqs", "max_num_batched_tokens", "rows"), [(4, 64, 4), (64, 8, 8)]
)
def test_step_buffers_are_sized_from_seqs_and_batched_tokens(
    tiny_model_dir, max_num_seqs, max_num_batched_tokens, rows
):
    """The logits buffer has max(1, min(max_num_seqs, max_num_batched_tokens)) rows, not a fixed
    128; the plan counts it once, and eager steps use the decode graphs' buffer."""
    args = EngineArgs(model=str(tiny_model_dir("llama")), device="cpu", max_model_len=64, quantization="int8",
                      kv_cache_memory="4MiB", max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    worker = Worker(resolve_worker_config(args))
    vocab = worker.info.model_config.vocab_size
    assert worker.memory_plan.buffer_bytes == rows * vocab * 4
    worker.initialize(CacheConfig(block_size=16, num_blocks=worker.info.num_kv_blocks))
    runner = worker.runner
    assert runner is not None and runner.decode_graphs is not None
    assert runner.decode_graphs.logits.shape == (rows, vocab)
    out = runner._logits_out(torch.zeros(rows, 8))
    assert out is not None and out.data_ptr() == runner.decode_graphs.logits.data_ptr()
    assert runner._logits_buffer is None  # no second buffer
