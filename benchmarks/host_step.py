"""The engine's host work per decode step with many requests, without a model: what bounds a
batch-256 step on a GPU, where the device's share is ~1.6 ms (issue 24).

Two parts, each timed per step over --steps steps (the median from the 100th on):
- the scheduler: ``schedule()`` then ``update_from_output()`` with one token per request, over
  gemma-3-270m's KV layout (kv_layout.py: a full-attention group and five window groups);
- the output side: ``OutputProcessor.process()`` then ``collect()`` with the embedded
  gemma-3-270m's tokenizer (incremental detokenizing, RequestOutputs).

    .venv/bin/python benchmarks/host_step.py [--requests 256] [--steps 400]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill.config import CacheConfig, ModelConfig, SchedulerConfig, resolve_model
from tokenmill.core import RunnerOutput, Scheduler
from tokenmill.core.sched_output import RequestUpdate
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.kv_layout import KVLayout, plan_kv_layout
from tokenmill.models.loader import load_model_config
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import load_tokenizer


def scheduler_ms(layout: KVLayout, num_requests: int, steps: int) -> float:
    cache = CacheConfig(
        block_size=16, enable_prefix_caching=True, num_blocks=200_000, kv_layout=layout
    )
    sched = Scheduler(SchedulerConfig(num_requests, 2048, 4096), cache)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(Request(f"r{i}", [(7 * i + j) % 250 + 3 for j in range(128)], params))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = sched.schedule()
        tokens = {rid: [5] for rid in out.num_scheduled_tokens}
        sched.update_from_output(out, RunnerOutput(tokens))
        times.append(time.perf_counter() - start)
    return statistics.median(times[100:]) * 1e3


def outputs_ms(config: ModelConfig, num_requests: int, steps: int) -> float:
    assert config.source is not None
    processor = OutputProcessor(load_tokenizer(config.source.path, config.architecture))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64)
    reqs = [Request(f"r{i}", [2, 100 + i, 200 + i], params) for i in range(num_requests)]
    for req in reqs:
        processor.add_request(req.req_id, None, [req], params)
    rng = random.Random(0)
    times = []
    for _ in range(steps):
        updates = []
        for req in reqs:
            token = rng.randrange(1000, 20000)
            req.output_token_ids.append(token)
            updates.append(RequestUpdate(req.req_id, [token]))
        start = time.perf_counter()
        processor.process(updates)
        processor.collect()
        times.append(time.perf_counter() - start)
    return statistics.median(times[100:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    ns = p.parse_args()
    if ns.steps <= 100:
        p.error("--steps must be over 100 (the first 100 are a warm-up)")
    config = load_model_config(resolve_model("gemma-3-270m"))
    layout = plan_kv_layout(config.layer_windows, 4096, True)
    print(f"{ns.requests} requests, {layout.num_groups} KV groups, median ms a step:")
    print(f"  schedule + update_from_output: {scheduler_ms(layout, ns.requests, ns.steps):.2f}")
    print(
        f"  output processing (process + collect): {outputs_ms(config, ns.requests, ns.steps):.2f}"
    )


if __name__ == "__main__":
    main()
