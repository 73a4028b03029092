"""tokenmill vs llama.cpp (llama-cpp-python, built from source) on the same GGUF, batch 1.

(a) decode tokens/s after a 128-token prompt; (b) prefill tokens/s for a 1,024-token prompt.
Both use 2 threads. Needs `pip install llama-cpp-python` (builds llama.cpp with the machine's gcc).

    python benchmarks/vs_llamacpp.py [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import time

from tokenmill.bench.workload import random_prompts
from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

DECODE_PROMPT, DECODE_TOKENS, PREFILL_PROMPT = 128, 128, 1024


def llamacpp(path: str, vocab: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2048, n_threads=2, n_batch=1024, verbose=False)
    out = {}
    prompt = random_prompts(1, PREFILL_PROMPT, vocab, seed=1)[0]
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    out["prefill_tok_s"] = PREFILL_PROMPT / (time.perf_counter() - start)
    llm.reset()
    llm.eval(random_prompts(1, DECODE_PROMPT, vocab, seed=2)[0])
    token = 1000
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        llm.eval([token])
        token = int(llm.scores[llm.n_tokens - 1].argmax())
    out["decode_tok_s"] = DECODE_TOKENS / (time.perf_counter() - start)
    return out


def tokenmill(quantization: str | None) -> tuple[dict, str, int]:
    engine = LLMEngine(
        EngineArgs(max_model_len=2048, kv_cache_memory="512MiB", quantization=quantization)
    )
    vocab = engine.config.model_config.vocab_size

    def run(prompt, n):
        rid = engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and o.request_id == rid:
                    return o.metrics

    run(random_prompts(1, 16, vocab, seed=9)[0], 4)  # warm-up
    m = run(random_prompts(1, PREFILL_PROMPT, vocab, seed=1)[0], 1)
    out = {"prefill_tok_s": PREFILL_PROMPT / m.ttft}
    m = run(random_prompts(1, DECODE_PROMPT, vocab, seed=2)[0], DECODE_TOKENS + 1)
    out["decode_tok_s"] = DECODE_TOKENS / (m.finished_time - m.first_token_time)
    return out, str(engine.config.model_config.source.path), vocab


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    tm, path, vocab = tokenmill(args.quantization)
    print("tokenmill", json.dumps(tm), flush=True)
    lc = llamacpp(path, vocab)
    print("llama.cpp", json.dumps(lc), flush=True)
    print(
        f"tokenmill/llama.cpp: decode {tm['decode_tok_s'] / lc['decode_tok_s']:.2f}x, "
        f"prefill {tm['prefill_tok_s'] / lc['prefill_tok_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
