"""``tokenmill estimate``: response time from TTFT and tokens/s, and the capacity planner.

tokenmill estimate --ttft 0.4 --tokens-per-second 50 --output-tokens 400   -> 8.4 s
tokenmill estimate --model gemma-3-270m --measure --output-tokens 400      (measures first)
tokenmill estimate --model MODEL --hardware h100|h200|a100|l4|measure [workload flags]
tokenmill estimate --model MODEL --hardware measure --validate   (planner vs tokenmill bench)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from typing import TextIO

from tokenmill.bench.hardware import Hardware, hardware_named, measure_hardware, with_price
from tokenmill.bench.planner import ModelFacts, Plan, PlanPoint, Workload, model_facts, plan
from tokenmill.config import KV_CACHE_DTYPES, parse_memory

__all__ = ["add_estimate_parser", "response_time", "run_estimate"]

VALIDATION_TOLERANCE = 0.20


def response_time(ttft_s: float, tokens_per_s: float, output_tokens: int) -> float:
    """Seconds from sending a request to its last token: TTFT + output tokens / tokens per s."""
    if ttft_s < 0 or tokens_per_s <= 0 or output_tokens < 0:
        raise ValueError("--ttft must be >= 0, --tokens-per-second > 0, --output-tokens >= 0")
    return ttft_s + output_tokens / tokens_per_s


def add_estimate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="response time from TTFT and tokens/s; plan a model's capacity on some hardware",
    )
    p.add_argument("--ttft", type=float, help="time to first token, seconds")
    p.add_argument("--tokens-per-second", type=float, help="decode tokens/s of one request")
    p.add_argument(
        "--output-tokens", "--output-len", dest="output_len", type=int, default=None,
        help="tokens each response has (default: 128)",
    )  # fmt: skip
    p.add_argument("--model", help="alias, .gguf or HF dir (for --measure and --hardware)")
    p.add_argument(
        "--measure", action="store_true", help="measure TTFT and tokens/s of --model here first"
    )
    p.add_argument(
        "--hardware", help="h200, h100, a100, l4, or measure (probe this machine's kernels)"
    )
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default: 512)")
    p.add_argument("--request-rate", type=float, default=None, help="arrivals, requests/s")
    p.add_argument(
        "--concurrency", default=None,
        help="concurrent requests to plan, e.g. 1,8,32 (default: powers of two up to the fit)",
    )  # fmt: skip
    p.add_argument("--price-per-hour", type=float, default=None, help="USD per hour")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--quantization", choices=("gguf", "none", "int8", "int4"), default=None)
    p.add_argument(
        "--kv-cache-memory", default=None,
        help="KV cache budget: bytes ('8GiB') or a fraction of the memory "
        "(default: 90%% of what the weights leave)",
    )  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--num-threads", type=int, default=None, help="threads to probe and measure")
    p.add_argument(
        "--validate", action="store_true",
        help="with --hardware measure: run tokenmill bench's measurements and compare",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_estimate(ns: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if ns.hardware:
        if not ns.model:
            raise ValueError("--hardware needs --model")
        return _run_planner(ns, out)
    if ns.measure:
        if not ns.model:
            raise ValueError("--measure needs --model")
        ttft, tps = _measure_latency(ns.model, ns.prompt_len, ns.num_threads)
    elif ns.ttft is None or ns.tokens_per_second is None:
        raise ValueError(
            "give --ttft and --tokens-per-second, or --model with --measure or --hardware"
        )
    else:
        ttft, tps = ns.ttft, ns.tokens_per_second
    output_len = 128 if ns.output_len is None else ns.output_len
    total = response_time(ttft, tps, output_len)
    if ns.json:
        result = {"ttft_s": ttft, "tokens_per_s": tps, "output_tokens": output_len}
        print(json.dumps(result | {"response_time_s": total}), file=out)
    else:
        print(
            f"response time: {total:.1f} s (TTFT {ttft:.2f} s + {output_len} output tokens "
            f"at {tps:.1f} tokens/s)",
            file=out,
        )
    return 0


def _measure_latency(model: str, prompt_len: int, threads: int | None) -> tuple[float, float]:
    """TTFT of a ``prompt_len`` prompt and decode tokens/s, measured here by tokenmill bench."""
    from tokenmill.bench.cli import latency
    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, num_threads=threads))
    result = latency(engine, input_len=prompt_len, output_len=64, num_iters=3)
    return result["ttft_s_median"], result["decode_tokens_per_s_median"]


def _hardware(ns: argparse.Namespace, facts: ModelFacts) -> Hardware:
    if ns.hardware.lower() == "measure":
        kinds = [*facts.dense_params_by_kind, facts.head_kind]
        if facts.num_experts:
            kinds.append(facts.expert_kind)
        heads = (facts.num_heads, facts.num_kv_heads, facts.head_dim)
        # The engine runs a layer's q/k/v and its gate/up as one matmul each: 4 calls a layer.
        layer_matrix = facts.dense_bytes // max(1, 4 * facts.num_layers)
        return measure_hardware(
            tuple(dict.fromkeys(kinds)),
            heads,
            layer_matrix,
            ns.num_threads,
            ns.price_per_hour or 0.0,
        )
    return with_price(hardware_named(ns.hardware), ns.price_per_hour)


def _kv_budget(value: str | None, memory_bytes: int) -> int | None:
    if value is None:
        return None
    budget = parse_memory(value)
    return int(budget * memory_bytes) if isinstance(budget, float) else budget


def _run_planner(ns: argparse.Namespace, out: TextIO) -> int:
    if ns.validate and ns.hardware.lower() != "measure":
        raise ValueError("--validate compares with measurements here: use --hardware measure")
    is_gpu = ns.hardware.lower() != "measure"
    if is_gpu:
        hardware_named(ns.hardware)  # a bad name fails before the model is read
    facts = model_facts(ns.model, ns.quantization, ns.kv_cache_dtype, gpu=is_gpu)
    hw = _hardware(ns, facts)
    concurrency = _concurrency_list(ns.concurrency)
    workload = Workload(
        prompt_len=ns.prompt_len,
        output_len=128 if ns.output_len is None else ns.output_len,
        concurrency=concurrency,
        request_rate=ns.request_rate,
        token_budget=ns.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        kv_cache_bytes=_kv_budget(ns.kv_cache_memory, hw.memory_bytes),
    )
    result = plan(facts, hw, workload)
    if ns.validate:
        rows = validate(facts, ns.model, hw, ns.num_threads)
        if ns.json:
            print(json.dumps({"plan": _plan_json(result), "validation": rows}), file=out)
        else:
            print_plan(result, out)
            print_validation(rows, out)
        return 0 if all(r["within_tolerance"] for r in rows) else 1
    if ns.json:
        print(json.dumps(_plan_json(result)), file=out)
    else:
        print_plan(result, out)
    return 0


def _concurrency_list(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--concurrency must be integers joined by commas; got {text!r}") from None


def print_plan(p: Plan, out: TextIO) -> None:
    m, hw, w = p.model, p.hardware, p.workload
    print(f"model: {m.name}: weights {m.weight_bytes / 1e9:.2f} GB, KV "
          f"{m.kv_bytes_per_token * m.num_layers / 1e3:.1f} KB a token", file=out)  # fmt: skip
    print(f"hardware: {hw.name}: {hw.bandwidth_bytes_per_s / 1e9:.0f} GB/s, matmul "
          f"{max(hw.matmul_ops_per_s.values()) / 1e12:.2f} TOP/s, memory "
          f"{hw.memory_bytes / 1e9:.0f} GB, ${hw.price_per_hour:g}/h", file=out)  # fmt: skip
    for note in hw.notes:
        print(f"  {note}", file=out)
    print(f"workload: prompt {w.prompt_len} + output {w.output_len} tokens; KV cache "
          f"{p.kv_cache_bytes / 1e9:.1f} GB fits {p.max_concurrency} such requests", file=out)  # fmt: skip
    print(
        f"\n{'concurrent':>10} {'TTFT s':>8} {'tok/s/user':>10} {'out tok/s':>10} "
        f"{'$/M out':>8} {'$/M total':>9}  bound by (decode)",
        file=out,
    )
    for pt in p.points:
        print(
            f"{pt.concurrency:>10} {pt.ttft_s:>8.3f} {pt.tokens_per_s_per_user:>10.1f} "
            f"{pt.output_tokens_per_s:>10.1f} {_usd(pt.cost_per_million_output):>8} "
            f"{_usd(pt.cost_per_million_total):>9}  {pt.decode_step.binding}",
            file=out,
        )
    if p.rate is not None:
        r = p.rate
        if r.point is None:
            print(f"\nrequest rate {r.request_rate:g}/s: more than it serves (at most "
                  f"{r.max_request_rate:.2f} requests/s): queues grow without bound", file=out)  # fmt: skip
        else:
            print(f"\nrequest rate {r.request_rate:g}/s: about {r.concurrency:.1f} requests in "
                  f"flight, response time {r.point.response_time_s:.2f} s, TTFT "
                  f"{r.point.ttft_s:.3f} s (at most {r.max_request_rate:.2f} requests/s)",
                  file=out)  # fmt: skip


def _usd(value: float | None) -> str:
    """Dollars, or '-' where there is no price (or no throughput) to divide."""
    return "-" if not value else f"{value:.3f}"


def _plan_json(p: Plan) -> dict:
    def point(pt: PlanPoint) -> dict:
        d = asdict(pt)
        d["binding"] = pt.decode_step.binding
        d["response_time_s"] = pt.response_time_s
        return d

    return {
        "model": asdict(p.model),
        "hardware": asdict(p.hardware),
        "workload": asdict(p.workload),
        "kv_cache_bytes": p.kv_cache_bytes,
        "max_concurrency": p.max_concurrency,
        "points": [point(pt) for pt in p.points],
        "rate": None
        if p.rate is None
        else asdict(p.rate) | {"point": None if p.rate.point is None else point(p.rate.point)},
    }


# What the validation compares: the three figures, each on the workload bench runs.
_CHECKS = (
    ("batch-1 decode tokens/s (512-token prompt)", 512, 128, 1),
    ("TTFT of a 512-token prompt, s", 512, 128, 1),
    ("16 concurrent: output tokens/s (128 + 128)", 128, 128, 16),
)


def validate(facts: ModelFacts, model: str, hw: Hardware, threads: int | None) -> list[dict]:
    """Predicted vs measured (tokenmill bench latency / throughput) on this machine."""
    from tokenmill.bench.cli import latency, throughput
    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, num_threads=threads))
    # Five timed prompts: the median then needs three slow ones, i.e. a neighbour busy for ~5 s.
    lat = latency(engine, input_len=512, output_len=128, num_iters=5)
    thr = throughput(engine, num_prompts=16, input_len=128, output_len=128)
    measured = (lat["decode_tokens_per_s_median"], lat["ttft_s_median"], thr["output_tokens_per_s"])
    rows = []
    for (name, prompt_len, output_len, c), value in zip(_CHECKS, measured):
        w = Workload(prompt_len=prompt_len, output_len=output_len, concurrency=(c,))
        pt = plan(facts, hw, w).points[0]
        if name.startswith("TTFT"):
            predicted, term = pt.ttft_s, _prefill_binding(facts, hw, prompt_len)
        elif c == 1:
            predicted, term = pt.tokens_per_s_per_user, pt.decode_step.binding
        else:
            predicted, term = pt.output_tokens_per_s, pt.decode_step.binding
        error = predicted / value - 1 if value else math.inf
        rows.append({
            "quantity": name,
            "predicted": predicted,
            "measured": value,
            "error": error,
            "within_tolerance": abs(error) <= VALIDATION_TOLERANCE,
            "dominant_term": term,
        })  # fmt: skip
    return rows


def _prefill_binding(facts, hw: Hardware, prompt_len: int) -> str:
    from tokenmill.bench.planner import prefill_steps

    steps = prefill_steps(facts, hw, 1, prompt_len, 2048)
    return max(steps, key=lambda s: s[0].total)[0].binding


def print_validation(rows: list[dict], out: TextIO) -> None:
    print("\nplanner vs tokenmill bench, this machine:", file=out)
    print(f"{'quantity':<46} {'predicted':>10} {'measured':>10} {'error':>7}", file=out)
    for r in rows:
        print(
            f"{r['quantity']:<46} {r['predicted']:>10.3f} {r['measured']:>10.3f} "
            f"{r['error']:>+7.0%}",
            file=out,
        )
        if not r["within_tolerance"]:
            print(
                f"  MISS (over {VALIDATION_TOLERANCE:.0%}): the '{r['dominant_term']}' term, "
                "which dominates this prediction, is mis-modelled",
                file=out,
            )
