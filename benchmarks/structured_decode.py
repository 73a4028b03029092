"""Decode speed constrained by a nested JSON schema against unconstrained, on gemma-3-270m.

1 and 16 concurrent requests, the same chat prompts, 128 tokens each (the schema asks for 30
orders, so no constrained output closes before max_tokens, and unconstrained ones ignore EOS:
both decode the same number of tokens). Median of 3 alternating rounds. Also the grammar compile
time, cold (the first request's, which builds llguidance's view of the 262k-token vocabulary),
for another schema, and cached.

    python benchmarks/structured_decode.py [--unbounded-strings]
"""

from __future__ import annotations

import time

from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "orders": {
            "type": "array",
            "minItems": 30,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "maxItems": 3,
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string", "maxLength": 12},
                                "qty": {"type": "integer", "minimum": 1},
                            },
                            "required": ["sku", "qty"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["id", "items"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "address", "tags", "orders"],
    "additionalProperties": False,
}
CITIES = ["Oslo", "Lima", "Pune", "Kyiv", "Doha", "Rome", "Nice", "Bern"]
MAX_TOKENS = 128


def prompts(n: int) -> list[str]:
    return [
        f"Write a customer record as JSON for a person in {CITIES[i % 8]} with two orders."
        for i in range(n)
    ]


def decode(
    engine: LLMEngine, texts: list[str], params: list[SamplingParams]
) -> tuple[float, list[int]]:
    """Output tokens/s from the first request's first token to the last one's end."""
    for text, p in zip(texts, params):
        engine.add_request(engine.tokenizer.encode_chat([{"role": "user", "content": text}]), p)
    lengths, first, last = [], None, 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                lengths.append(len(out.outputs[0].token_ids))
                first = min(first or out.metrics.first_token_time, out.metrics.first_token_time)
                last = max(last, out.metrics.finished_time)
    return (sum(lengths) - len(lengths)) / (last - first), lengths


def without_string_bounds(schema):
    """The schema without maxLength and pattern: llguidance masks unbounded strings fast
    (~16 us a row here) and bounded ones slowly (~125 us: gemma's 262k tokens are checked)."""
    if isinstance(schema, dict):
        return {
            k: without_string_bounds(v)
            for k, v in schema.items()
            if k not in ("maxLength", "pattern")
        }
    if isinstance(schema, list):
        return [without_string_bounds(v) for v in schema]
    return schema


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--unbounded-strings", action="store_true", help="drop maxLength/pattern")
    ns = parser.parse_args()
    engine = LLMEngine(EngineArgs(max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=16))
    schema = without_string_bounds(SCHEMA) if ns.unbounded_strings else SCHEMA
    spec = StructuredOutputs(json=schema)
    start = time.perf_counter()
    engine.grammar_compiler.compile(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    engine.grammar_compiler.compile(spec)
    cached = time.perf_counter() - start
    other = StructuredOutputs(json={**schema, "required": ["name"]})
    start = time.perf_counter()
    engine.grammar_compiler.compile(other)
    warm = time.perf_counter() - start
    print(f"compile: cold {cold * 1e3:.0f} ms (tokenizer included), another schema "
          f"{warm * 1e3:.1f} ms, cached {cached * 1e6:.0f} us")  # fmt: skip
    decode(engine, prompts(1), [SamplingParams(max_tokens=8)])  # warm-up
    print("| concurrent | unconstrained tok/s | constrained tok/s | ratio |\n|---|---|---|---|")
    constrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for n in (1, 16):
        rounds = []
        for _ in range(3):
            c_speed, c_lengths = decode(engine, prompts(n), [constrained] * n)
            f_speed, f_lengths = decode(engine, prompts(n), [free] * n)
            assert c_lengths == f_lengths == [MAX_TOKENS] * n
            rounds.append((f_speed, c_speed))
        f_speed = sorted(r[0] for r in rounds)[1]
        c_speed = sorted(r[1] for r in rounds)[1]
        print(f"| {n} | {f_speed:.1f} | {c_speed:.1f} | {c_speed / f_speed:.3f} |", flush=True)


if __name__ == "__main__":
    main()
