"""The CUDA backend on a real GPU, in one run: greedy output against the CPU's exact mode, the
device's probed bandwidth and bf16 matmul peak, and decode / prefill / throughput figures each
beside its roofline limit from those probes (issue 24's targets).

    python benchmarks/gpu_check.py --out gpu_check.json          # on an NVIDIA GPU
    python benchmarks/gpu_check.py --smoke --device cpu --model DIR  # its code path on a CPU

``benchmarks/gpu_check.sh`` wraps it with the CUDA test subset and a time limit. Each part is
recorded on its own: a part that fails writes its error into the JSON and the rest still run.

Roofline of a step: max(bytes it moves / probed bandwidth, FLOPs / probed bf16 peak). Bytes are
the weights read once, the K/V the batch attends to and the elementwise ops' activations;
FLOPs 2 per weight per token plus attention's 4 x heads x head_dim per key.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.bench.cli import latency, throughput
from tokenmill.bench.planner import ModelFacts, model_facts
from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each measurement is: the real run's, or a smoke run's on a CPU."""

    greedy_tokens: int = 32
    copy_bytes: int = 1 << 30
    matmul_n: int = 8192
    decode_input: int = 128
    decode_output: int = 256
    prefill_input: int = 2048
    concurrencies: tuple[int, ...] = (64, 256)
    throughput_output: int = 256
    step_batch: int = 256
    step_count: int = 32
    max_model_len: int = 4096


SMOKE = Sizes(
    greedy_tokens=6,
    copy_bytes=16 << 20,
    matmul_n=256,
    decode_input=16,
    decode_output=8,
    prefill_input=64,
    concurrencies=(4,),
    throughput_output=8,
    step_batch=4,
    step_count=3,
    max_model_len=256,
)


# ---- probes -------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    fn()  # warm-up: allocation, kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def probe_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes a second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), device)


def probe_matmul_peak(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n bf16 matmul (float32 on a CPU, whose bf16 matmul is emulated)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _best_seconds(lambda: a @ b, device)


# ---- roofline -----------------------------------------------------------------------------


def decode_roofline_s(m: ModelFacts, bw: float, peak: float, batch: int, context: int) -> float:
    """The roofline time of one decode step of ``batch`` requests at ``context`` tokens."""
    kv_tokens = m.kv_tokens_read(context)
    bytes_moved = (
        m.dense_bytes
        + m.head_bytes
        + batch * kv_tokens * m.kv_bytes_per_token
        + batch * m.activation_bytes_per_token
    )
    flops = batch * (
        2 * (m.dense_params + m.head_params) + 4 * m.num_heads * m.head_dim * kv_tokens
    )
    return max(bytes_moved / bw, flops / peak)


def prefill_matmul_flops(m: ModelFacts, num_tokens: int) -> float:
    """The linear layers' FLOPs of a prompt of ``num_tokens`` (the head runs for one row)."""
    return 2 * m.dense_params * num_tokens + 2 * m.head_params


# ---- the parts ----------------------------------------------------------------------------


def greedy_check(model: str, engine: LLMEngine, n: int) -> dict:
    """Greedy tokens of the CPU's exact mode (float32, weights dequantized, float32
    activations, the torch kernels) against the device's: the common prefix of free-running
    output, and teacher-forced top-1 agreement (the device scoring the CPU's text)."""
    cpu = LLMEngine(
        EngineArgs(
            model=model,
            device="cpu",
            dtype="float32",
            quantization="none",
            kernel_backend="torch",
            enforce_eager=True,
            max_model_len=512,
            kv_cache_memory="256MiB",
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    rows = []
    for prompt in PROMPTS:
        ref = _generate(cpu, prompt, greedy)
        got = _generate(engine, prompt, greedy)
        prompt_ids = engine.tokenize_prompt(prompt)
        scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        out = _run(engine, prompt_ids + ref, scored)
        lps = out.prompt_logprobs[len(prompt_ids) :]
        agree = sum(1 for lp in lps if lp is not None and lp.sampled.rank == 1)
        prefix = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        rows.append({"prompt": prompt, "common_prefix": prefix, "top1_agreement": agree / n})
    cpu.shutdown()
    worst = min(r["top1_agreement"] for r in rows)
    # bf16 rounding may flip a near-tie: 95% of teacher-forced positions must agree.
    return {"prompts": rows, "min_top1_agreement": worst, "passed": worst >= 0.95}


def _run(engine: LLMEngine, prompt: str | list[int], params: SamplingParams):
    engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final


def _generate(engine: LLMEngine, prompt: str, params: SamplingParams) -> list[int]:
    return _run(engine, prompt, params).outputs[0].token_ids


def decode_step_time(engine: LLMEngine, batch: int, steps: int, input_len: int) -> dict:
    """Mean time of ``steps`` decode steps with ``batch`` requests running (after their
    prefills), and the context they ran at."""
    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % (vocab - 1) + 1 for j in range(input_len)], params)
    while engine.stats().num_waiting or engine.stats().num_running < batch:
        engine.step()
    engine.step()  # every request has decoded once: the step's graph and buffers exist
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "context": input_len + 2 + steps // 2, "step_s": elapsed}


def run(ns: argparse.Namespace) -> dict:
    sizes = SMOKE if ns.smoke else Sizes()
    device = torch.device(ns.device if ns.device != "auto" else _auto_device())
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": ns.model,
        "smoke": ns.smoke,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None

    def part(name: str, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - each part reports its own failure
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name} ({time.perf_counter() - start:.1f} s): {result[name]}", file=sys.stderr)

    part("bandwidth_bytes_per_s", lambda: probe_bandwidth(device, sizes.copy_bytes))
    part("matmul_flops_per_s", lambda: probe_matmul_peak(device, sizes.matmul_n))
    bw, peak = result["bandwidth_bytes_per_s"], result["matmul_flops_per_s"]
    if isinstance(bw, dict) or isinstance(peak, dict):
        return result
    # The weights as the engine holds them: a GGUF dequantized to bf16 on a GPU, packed on a CPU.
    on_gpu = device.type == "cuda"
    facts = model_facts(ns.model, quantization="none" if on_gpu else None, gpu=on_gpu)
    max_seqs = max(sizes.step_batch, *sizes.concurrencies)
    engine = LLMEngine(
        EngineArgs(
            model=ns.model,
            device=str(device),
            kernel_backend=ns.kernel_backend,
            max_model_len=sizes.max_model_len,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max(2048, sizes.prefill_input),
            enforce_eager=ns.enforce_eager,
        )
    )
    result["engine"] = {"dtype": engine.config.dtype, "num_kv_blocks": engine.num_total_blocks}
    part("greedy", lambda: greedy_check(ns.model, engine, sizes.greedy_tokens))

    def decode_b1() -> dict:
        r = latency(
            engine, input_len=sizes.decode_input, output_len=sizes.decode_output, num_iters=3
        )
        context = sizes.decode_input + sizes.decode_output // 2
        limit = 1.0 / decode_roofline_s(facts, bw, peak, 1, context)
        tok_s = r["decode_tokens_per_s_median"]
        return {"tokens_per_s": tok_s, "roofline_tokens_per_s": limit, "ratio": tok_s / limit,
                "target_tokens_per_s": 1000, "met": tok_s >= 1000}  # fmt: skip

    def prefill() -> dict:
        r = latency(engine, input_len=sizes.prefill_input, output_len=1, num_iters=3)
        rate = prefill_matmul_flops(facts, sizes.prefill_input) / r["ttft_s_median"]
        return {"tokens_per_s": r["prefill_tokens_per_s"], "matmul_flops_per_s": rate,
                "fraction_of_peak": rate / peak, "target_fraction": 0.4,
                "met": rate / peak >= 0.4}  # fmt: skip

    def step_at_batch() -> dict:
        r = decode_step_time(engine, sizes.step_batch, sizes.step_count, sizes.decode_input)
        limit = decode_roofline_s(facts, bw, peak, r["batch"], r["context"])
        return {**r, "roofline_step_s": limit, "ratio": r["step_s"] / limit,
                "target_ratio": 2.0, "met": r["step_s"] <= 2.0 * limit}  # fmt: skip

    def concurrent(c: int) -> Callable[[], dict]:
        def measure() -> dict:
            r = throughput(
                engine, num_prompts=c, input_len=sizes.decode_input,
                output_len=sizes.throughput_output,
            )  # fmt: skip
            context = sizes.decode_input + sizes.throughput_output // 2
            limit = c / decode_roofline_s(facts, bw, peak, c, context)
            out = r["output_tokens_per_s"]
            return {"output_tokens_per_s": out, "roofline_tokens_per_s": limit,
                    "ratio": out / limit, "ttft_s_median": r["ttft_s_median"]}  # fmt: skip

        return measure

    part("decode_batch1", decode_b1)
    part("prefill", prefill)
    part("decode_step_at_batch", step_at_batch)
    for c in sizes.concurrencies:
        part(f"throughput_{c}", concurrent(c))
    engine.shutdown()
    return result


def _auto_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--kernel-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: the code path on a CPU")
    p.add_argument("--out", help="where to write the JSON of results")
    ns = p.parse_args(argv)
    result = run(ns)
    text = json.dumps(result, indent=2, default=str)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
