"""A mixture of experts against the dense model of its active size, decoding on this CPU.

Two random-weight GGUF models, written here (and cached under ~/.cache/tokenmill/bench-moe):
  moe:   Mixtral's shape scaled to hidden 1024: 8 layers, 16 heads of 64 (4 KV heads), vocab
         32000, 8 experts of width 3584 (3.5x hidden), top-2;
  dense: the same with one MLP of width 7168 = the two active experts' (the same active
         parameters a token; a quarter of the MoE's MLP weights).
Both are quantized alike: every matrix to one type (``--type``, Q4_K by default, llama.cpp's
``llama-quantize --pure``; Q8_0 by the gguf package where llama-quantize is not built), the
routers kept F32 as llama.cpp keeps them.

Measured in one run, alternating rounds (median of ``--rounds``):
  - decode tokens/s of one request (32-token prompt, 128 new tokens; decode steps only), with
    decode-step graphs and eagerly (--enforce-eager), and llama.cpp's llama-bench tg128 where
    it is built (shared/peers/build-llamacpp.sh);
  - output tokens/s of 32 concurrent requests (32-token prompts, 64 new tokens), and for the MoE
    the tokens each expert ran (router statistics): min and max share per layer;
  - one MoE layer's time (router and experts) at 1 and 32 tokens: the fast path (the C
    kernels) against the loop-over-experts reference (moe/reference.py) on its float weights.

    python benchmarks/moe_decode.py [--type Q4_K|Q8_0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 8, 16, 4, 64, 32000
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 3584
DENSE_WIDTH = TOP_K * EXPERT_WIDTH
CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / "bench-moe"
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "peers")) / "build-llamacpp" / "bin"


def cpu_name() -> str:
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2"
    return (
        f"{info.get('model name')} (family {info.get('cpu family')}, {isa}, {os.cpu_count()} CPUs)"
    )


def write_f16(path: Path, moe: bool, seed: int) -> None:
    """A random-weight llama-architecture GGUF in F16 (norms and routers F32)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(EXPERT_WIDTH if moe else DENSE_WIDTH)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if moe:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(TOP_K)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"\u2581t{i}" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3, *[6] * 256, *[1] * (VOCAB - 259)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(*shape: int) -> np.ndarray:  # scaled so activations stay O(1) through 8 layers
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(
            np.float16
        )

    w.add_tensor("token_embd.weight", matrix(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output.weight", matrix(VOCAB, HIDDEN))
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", matrix(HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(b + "attn_k.weight", matrix(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(b + "attn_v.weight", matrix(KV_HEADS * HEAD_DIM, HIDDEN))
        w.add_tensor(b + "attn_output.weight", matrix(HIDDEN, HEADS * HEAD_DIM))
        w.add_tensor(b + "ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        if moe:
            router = rng.standard_normal((EXPERTS, HIDDEN), dtype=np.float32) / np.sqrt(HIDDEN)
            router = router.astype(np.float32)
            w.add_tensor(b + "ffn_gate_inp.weight", router)
            w.add_tensor(b + "ffn_gate_exps.weight", matrix(EXPERTS, EXPERT_WIDTH, HIDDEN))
            w.add_tensor(b + "ffn_up_exps.weight", matrix(EXPERTS, EXPERT_WIDTH, HIDDEN))
            w.add_tensor(b + "ffn_down_exps.weight", matrix(EXPERTS, HIDDEN, EXPERT_WIDTH))
        else:
            w.add_tensor(b + "ffn_gate.weight", matrix(DENSE_WIDTH, HIDDEN))
            w.add_tensor(b + "ffn_up.weight", matrix(DENSE_WIDTH, HIDDEN))
            w.add_tensor(b + "ffn_down.weight", matrix(HIDDEN, DENSE_WIDTH))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantized(name: str, moe: bool, qtype: str) -> Path:
    """The model in ``qtype``: llama-quantize --pure where built, else (Q8_0) re-encoded here."""
    CACHE.mkdir(parents=True, exist_ok=True)
    out = CACHE / f"{name}-{qtype}.gguf"
    if out.exists():
        return out
    f16 = CACHE / f"{name}-F16.gguf"
    if not f16.exists():
        write_f16(f16, moe, seed=1 if moe else 2)
    quantize = PEERS / "llama-quantize"
    if quantize.exists():
        subprocess.run(
            [str(quantize), "--pure", str(f16), str(out), qtype], check=True, capture_output=True
        )
    elif qtype == "Q8_0":
        _requantize_q8_0(f16, out)
    else:
        raise SystemExit(f"{qtype} needs llama-quantize: bash shared/peers/build-llamacpp.sh")
    return out


def _requantize_q8_0(src: Path, dst: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        data = np.asarray(t.data)
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type == gguf.GGMLQuantizationType.F16:
            q = gguf.quants.quantize(
                data.reshape(shape).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
            )
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data.reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(259, VOCAB) for _ in range(31)] for _ in range(n)]


def decode_rate(engine: LLMEngine, new_tokens: int) -> float:
    """Decode tokens/s of one request: from its first token (the prefill's) to its last."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(prompts(1, seed=time.monotonic_ns())[0], params)
    first = None
    while engine.has_unfinished_requests():
        engine.step()
        if first is None:
            first = time.perf_counter()
    return (new_tokens - 1) / (time.perf_counter() - first)


def throughput(engine: LLMEngine, n: int, new_tokens: int) -> float:
    """Output tokens/s of n concurrent requests, prefills included."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts(n, seed=time.monotonic_ns()):
        engine.add_request(p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n * new_tokens / (time.perf_counter() - start)


def llama_bench(path: Path) -> float | None:
    """llama.cpp's decode tokens/s (tg128, batch 1, 2 threads), where llama-bench is built."""
    bench = PEERS / "llama-bench"
    if not bench.exists():
        return None
    out = subprocess.run(
        [
            str(bench),
            "-m",
            str(path),
            "-p",
            "0",
            "-n",
            "128",
            "-t",
            str(os.cpu_count()),
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(json.loads(out)[0]["avg_ts"])


def layer_times(engine: LLMEngine) -> None:
    """ms of layer 0's MoE MLP, fast path against the reference over its dequantized stacks."""
    import torch

    from tokenmill.kernels.torch_backend import expert_rows
    from tokenmill.moe.reference import reference_moe

    block = engine.executor.worker.model.model.layers[0].mlp
    stacks, width = block.experts.packed, EXPERT_WIDTH
    gate_up = torch.stack(
        [expert_rows(stacks["gate_up"], e, 2 * width).dequantize() for e in range(EXPERTS)]
    )
    down = torch.stack(
        [expert_rows(stacks["down"], e, HIDDEN).dequantize() for e in range(EXPERTS)]
    )
    router = block.gate.weight

    def best_ms(fn, reps: int = 20) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    for tokens in (1, 32):
        x = torch.randn(tokens, HIDDEN)
        fast = best_ms(lambda x=x: block(x))
        ref = best_ms(lambda x=x: reference_moe(x, router, TOP_K, True, gate_up, down, "silu"))
        print(
            f"  {tokens:2d} tokens: fast {fast:6.2f} ms  reference {ref:6.2f} ms  ({ref / fast:.1f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="Q4_K", choices=("Q4_K", "Q8_0"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    paths = {
        "moe": quantized("moe", True, args.type),
        "dense": quantized("dense", False, args.type),
    }
    how = "llama-quantize --pure" if (PEERS / "llama-quantize").exists() else "gguf package"
    print(f"CPU: {cpu_name()}; every matrix {args.type} ({how}), routers F32")
    engines = {}
    for name, path in paths.items():
        for eager in (False, True):
            engines[name, eager] = LLMEngine.from_args(
                model=str(path),
                max_model_len=512,
                max_num_seqs=32,
                kv_cache_memory="1GiB",
                enforce_eager=eager,
                moe_router_stats=name == "moe" and not eager,
                enable_prefix_caching=False,
            )
            decode_rate(engines[name, eager], 8)  # warm-up: captures the batch-1 graph
    info = {name: engines[name, False].executor.info for name in paths}
    for name in paths:
        print(f"{name}: {info[name].weight_nbytes / 2**20:.0f} MiB of weights")
    rates: dict[tuple[str, bool], list[float]] = {key: [] for key in engines}
    for _ in range(args.rounds):
        for key, engine in engines.items():
            rates[key].append(decode_rate(engine, 128))
    med = {key: statistics.median(v) for key, v in rates.items()}
    print("\ndecode, 1 request (tok/s, median of rounds):")
    for eager in (False, True):
        mode = "eager " if eager else "graphs"
        moe, dense = med["moe", eager], med["dense", eager]
        print(
            f"  {mode}  moe {moe:6.1f}  dense {dense:6.1f}  time ratio moe/dense {dense / moe:.2f}x"
        )
    peers = {name: llama_bench(path) for name, path in paths.items()}
    if peers["moe"] is not None:
        print(
            f"  llama.cpp moe {peers['moe']:6.1f}  dense {peers['dense']:6.1f}  "
            f"time ratio {peers['dense'] / peers['moe']:.2f}x"
        )
    print("\n32 concurrent requests, 64 new tokens each (output tok/s, median of rounds):")
    before = engines["moe", False].stats().expert_tokens or {}
    tput = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name in paths:
            tput[name].append(throughput(engines[name, False], 32, 64))
    for name in paths:
        print(f"  {name:5s} {statistics.median(tput[name]):7.1f}")
    after = engines["moe", False].stats().expert_tokens or {}
    print("\nMoE tokens per expert over the 32-request rounds (share of the layer's, min-max):")
    for layer, counts in after.items():
        ran = np.array(counts) - np.array(before.get(layer, (0,) * EXPERTS))
        share = ran / ran.sum()
        print(f"  layer {layer}: {share.min():.3f}-{share.max():.3f}  (uniform {1 / EXPERTS:.3f})")
    print("\nOne MoE layer (router + experts), best of 20:")
    layer_times(engines["moe", False])


if __name__ == "__main__":
    main()
