"""How a thinking budget bounds a reasoning model's response time, measured next to the
arithmetic that predicts it (``tokenmill estimate``'s: TTFT + tokens / decode tokens/s).

A reasoning model's reply is its thinking, then its answer; the answer comes after the last
thinking token, so the time to the answer is TTFT + (thinking tokens + the closing tag) /
tokens per second. ``max_thinking_tokens`` B makes the thinking at most B tokens. Random
weights never close their thinking on their own, so with a budget the thinking is exactly B
tokens, and without one it runs to ``max_tokens``: the cases are exact, the times real (the
shapes and file types are a real model's). The prompt ends in an open ``<think>`` block, as
DeepSeek-R1's template leaves it; the model runs with ``--reasoning-parser deepseek_r1``.

    python benchmarks/thinking_budget.py --model ~/.cache/llama-shapes/llama-1b-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import time

PROMPT = "Question: is 1001 a prime number? Think it through before you answer.\n<think>\n"
ANSWER_TOKENS = 32


def run(engine, budget: int | None, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first answer token, seconds to the end, thinking tokens)."""
    from tokenmill.reasoning import THINK_END
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, max_thinking_tokens=budget
    )
    start = time.perf_counter()
    engine.add_request(PROMPT, params)
    answer_at, text, tokens = None, "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text_delta
            tokens = out.outputs[0].token_ids
            if answer_at is None and THINK_END in text and not text.endswith(THINK_END):
                answer_at = time.perf_counter() - start
    end = time.perf_counter() - start
    tag = engine.tokenizer.encode(THINK_END, add_special_tokens=False)
    thinking = next((i for i in range(len(tokens)) if tokens[i : i + len(tag)] == tag), len(tokens))
    return (answer_at if answer_at is not None else end), end, thinking


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--budgets", default="0,64,256")
    parser.add_argument("--max-tokens", type=int, default=512, help="the unbudgeted thinking")
    ns = parser.parse_args()

    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(model=ns.model, max_model_len=2048, reasoning_parser="deepseek_r1")
    )
    run(engine, 4, 8)  # warm up: decode graphs, caches
    # The unbudgeted run gives TTFT and decode tokens/s, as `tokenmill estimate --measure`.
    engine.add_request(PROMPT, _params(ns.max_tokens))
    first = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for _ in engine.step():
            first = first or time.perf_counter() - start
    total = time.perf_counter() - start
    assert first is not None
    rate = (ns.max_tokens - 1) / (total - first)
    print(f"model {ns.model}: TTFT {first * 1000:.0f} ms, decode {rate:.1f} tokens/s")
    (end_len,) = {len(engine.tokenizer.encode("</think>", add_special_tokens=False))}
    print("| budget | thinking tokens | to the answer: predicted | measured | whole reply "
          f"(+{ANSWER_TOKENS} answer tokens): predicted | measured |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| none | {ns.max_tokens} (to max_tokens) | never | never | "
          f"{first + (ns.max_tokens - 1) / rate:.2f} s | {total:.2f} s |")  # fmt: skip
    for budget in [int(b) for b in ns.budgets.split(",")]:
        max_tokens = budget + end_len + ANSWER_TOKENS
        answer_at, end, thinking = run(engine, budget, max_tokens)
        to_answer = first + (budget + end_len - 1) / rate
        whole = first + (max_tokens - 1) / rate
        print(f"| {budget} | {thinking} | {to_answer:.2f} s | {answer_at:.2f} s | "
              f"{whole:.2f} s | {end:.2f} s |")  # fmt: skip


def _params(max_tokens: int):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


if __name__ == "__main__":
    main()
