"""Perplexity of a model over a public-domain text (Hamlet, benchmarks/data/hamlet.txt), through
tokenmill.LLM's prompt log-probs, in windows of --window tokens every --stride tokens.

    python benchmarks/perplexity.py                          # gemma-3-270m, whole text
    python benchmarks/perplexity.py --max-tokens-total 2048 --quantization int8
    python benchmarks/perplexity.py --window 1024 --stride 512 --max-num-batched-tokens 256
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill import LLM
from tokenmill.bench.perplexity import measure_perplexity

DEFAULT_TEXT = Path(__file__).parent / "data" / "hamlet.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--window", type=int, default=1024, help="tokens per request, BOS included")
    parser.add_argument("--stride", type=int, default=None, help="default: --window (no overlap)")
    parser.add_argument("--max-tokens-total", type=int, default=None, help="tokens to score")
    # Engine options, passed on only when given.
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--packed-activations", default=None, help="int8 (default) or float32")
    parser.add_argument("--int4-group-size", type=int, default=None, help="32 (default) or 128")
    parser.add_argument("--int4-calibration", default=None, help="text file for int4's imatrix")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--decode-kernel",
        action="store_true",
        help="with --packed-activations float32: score every row with the packed kernel's float "
        "mode, as decode computes (prefill otherwise expands packed tiles for the float GEMM); "
        "int8 activations run the kernel at every batch size anyway",
    )
    args = parser.parse_args()
    if args.decode_kernel:
        import tokenmill.quant.gguf

        tokenmill.quant.gguf.FLOAT_GEMM_MIN_ROWS = 1 << 62
    engine_args = {
        name: getattr(args, name)
        for name in (
            "quantization",
            "kv_cache_dtype",
            "dtype",
            "max_num_batched_tokens",
            "packed_activations",
            "int4_group_size",
            "int4_calibration",
        )
        if getattr(args, name) is not None
    }
    llm = LLM(args.model, max_model_len=args.window + 1, **engine_args)
    result = measure_perplexity(
        llm, args.text.read_text(), args.window, args.stride, args.max_tokens_total
    )
    options = ", ".join(f"{k}={v}" for k, v in engine_args.items()) or "engine defaults"
    if args.decode_kernel:
        options += " (every row through the decode kernel)"
    stride = args.stride or args.window
    print(f"{args.model} on {args.text.name}: window {args.window}, stride {stride}, {options}")
    print(f"tokens scored: {result.num_tokens} in {result.num_windows} windows")
    print(f"mean NLL:      {result.mean_nll:.4f} nats/token")
    print(f"perplexity:    {result.perplexity:.3f}")
    print(
        f"seconds:       {result.seconds:.2f} ({result.num_tokens / result.seconds:.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
