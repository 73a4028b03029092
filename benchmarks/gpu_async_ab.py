"""Async scheduling against steps one at a time on a GPU, engines alternating (sync, async,
sync, async) over the same workload: throughput of 256 and 64 requests (128-token prompts, 256
out), and the decode step at batch 256 and 1. The host's speed varies from engine to engine;
alternating shows which differences outlast it.

    OUT=dir python benchmarks/gpu_async_ab.py [--synthetic DIR | --model MODEL]

Writes $OUT/async_ab.json (or ./async_ab.json), one row an engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import build_synthetic_gemma, decode_step_time  # noqa: E402

from tokenmill.bench.cli import throughput  # noqa: E402
from tokenmill.config import EngineArgs  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--synthetic", metavar="DIR", help="gemma-3-270m's shapes, random weights")
    ns = p.parse_args()
    model = build_synthetic_gemma(Path(ns.synthetic)) if ns.synthetic else ns.model
    rows = []
    for async_scheduling in (False, True, False, True):
        engine = LLMEngine(
            EngineArgs(
                model=model,
                max_model_len=4096,
                max_num_seqs=256,
                gpu_memory_utilization=0.3,  # fewer KV blocks: a quicker start, room enough
                async_scheduling=async_scheduling,
            )
        )
        row: dict = {"async": async_scheduling}
        for c in (256, 64):
            r = throughput(engine, num_prompts=c, input_len=128, output_len=256)
            row[f"tput{c}"] = r["output_tokens_per_s"]
            row[f"ttft{c}"] = r["ttft_s_median"]
        row["step256"] = decode_step_time(engine, 256, 32, 128)["step_s"]
        row["step1"] = decode_step_time(engine, 1, 32, 128)["step_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "."), "async_ab.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
