"""Batch-1 decode of an input-grounded task with and without n-gram speculation, one process.

gemma-3-270m is given a Python file (tokenmill/spec/ngram.py) and asked for it again; greedy,
256 tokens. Prints decode tokens/s, steps and tokens per step for each setting, and whether the
two outputs agree (they may part where the packed kernels' rounding differs between a matmul
of 1 row and one of 1 + K rows: see tests/spec/test_spec_decode.py).

    python benchmarks/spec_ngram.py [--num-speculative-tokens 3 6]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

OUTPUT_TOKENS = 256


def run(method: str | None, num_tokens: int, prompt: str) -> tuple[float, int, list[int]]:
    engine = LLMEngine(
        EngineArgs(
            max_model_len=4096,
            kv_cache_memory="256MiB",
            speculative_method=method,
            num_speculative_tokens=num_tokens,
        )
    )
    engine.add_request("warm up", SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS))
    num_steps, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
        num_steps += 1
    assert out is not None
    tokens = out.outputs[0].token_ids
    m = out.metrics
    return (len(tokens) - 1) / (m.finished_time - m.first_token_time), num_steps, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3, 6])
    ns = parser.parse_args()
    code = (Path(__file__).parents[1] / "tokenmill/spec/ngram.py").read_text()
    prompt = f"Here is a Python file:\n\n{code}\n\nThe same file again, unchanged:\n\n"
    base_speed, base_steps, base_tokens = run(None, 1, prompt)
    print("| setting | decode tok/s | speedup | steps | tokens/step | same output |")
    print("|---|---|---|---|---|---|")
    print(f"| no speculation | {base_speed:.1f} | 1.00x | {base_steps} | 1.00 | - |")
    for k in ns.num_speculative_tokens:
        speed, steps, tokens = run("ngram", k, prompt)
        same = "yes" if tokens == base_tokens else "no"
        print(
            f"| ngram, K={k} | {speed:.1f} | {speed / base_speed:.2f}x | {steps} | "
            f"{len(tokens) / steps:.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
