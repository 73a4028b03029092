"""Fidelity of a quantized run as llama.cpp's `llama-perplexity --kl-divergence` measures it:
mean KL divergence from the float model and top-1 agreement with it, over a text.

The float model is the file's own weights dequantized: both engines then start from the same
weights, and what is measured is what their arithmetic (int8 activations, kernels) costs.
The text (default benchmarks/data/hamlet.txt) goes in chunks of --ctx tokens, BOS first, and
the second half of each chunk is scored, as llama-perplexity scores it.
  tokenmill: the model loaded twice in one process, the reference with quantization="none"
    (float32 weights, float arithmetic) and the default mode (packed weights, int8
    activations), one prefill a chunk in each; with --isa, once more in a subprocess per
    instruction set (TOKENMILL_ISA: avx2, avx512vnni, amx where the CPU runs it).
  llama.cpp: llama-perplexity (built beside ../shared/peers/build-llamacpp.sh's tools) on an
    F32 GGUF of the dequantized weights (written here, --kl-divergence-base), then on the file.

    python benchmarks/kl_divergence.py [--model gemma-3-270m] [--ctx 512] [--chunks 8]
        [--isa avx2,avx512vnni] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from memory_startup import LLAMA_BIN

DEFAULT_TEXT = Path(__file__).parent / "data" / "hamlet.txt"


def tokenmill_kl(model: str, text: Path, ctx: int, chunks: int) -> dict[str, float]:
    """Mean KL(float || default) and top-1 agreement over the scored halves of the chunks."""
    from tokenmill import LLM
    from tokenmill.config import CacheConfig
    from tokenmill.worker.memory import dummy_prefill

    common = dict(max_model_len=ctx, kv_cache_memory="64MiB", enforce_eager=True)
    ref = LLM(model, quantization="none", **common)
    ours = LLM(model, **common)
    tokenizer = ours.engine.tokenizer
    ids = tokenizer.encode(text.read_text(), add_special_tokens=False)
    bos = ours.engine.config.model_config.bos_token_id
    kl_sum, agree, scored = 0.0, 0, 0
    cpu = torch.device("cpu")
    for c in range(chunks):
        chunk = ids[c * (ctx - 1) : (c + 1) * (ctx - 1)]
        if len(chunk) < ctx - 1:
            break
        tokens = torch.tensor([bos, *chunk])
        logprobs = []
        for llm in (ref, ours):
            model_ = llm.engine.executor.worker.model
            run = dummy_prefill(model_, CacheConfig(16), torch.float32, cpu, ctx, ctx, ctx,
                                input_ids=tokens)  # fmt: skip
            logprobs.append(run()[ctx // 2 : -1])  # the second half's predictions
        p, q = logprobs
        kl_sum += (p.exp() * (p - q)).sum(-1).sum().item()
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        scored += p.shape[0]
    return {"kl": kl_sum / scored, "top1": agree / scored, "tokens": scored}


def write_f32_gguf(source: Path, out: Path) -> None:
    """A copy of ``source`` with every tensor dequantized to F32 (metadata as it was)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_kl(model_path: Path, text: Path, ctx: int, chunks: int, work: Path) -> dict:
    perplexity = LLAMA_BIN / "llama-perplexity"
    if not perplexity.exists():
        build = LLAMA_BIN.parent
        subprocess.run(["cmake", "--build", str(build), "-j", "2", "--target", "llama-perplexity"],
                       check=True, capture_output=True)  # fmt: skip
    f32, base = work / "f32.gguf", work / "logits.kld"
    if not f32.exists():
        write_f32_gguf(model_path, f32)
    common = ["-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", "2"]
    subprocess.run([str(perplexity), "-m", str(f32), *common, "--kl-divergence-base", str(base)],
                   check=True, capture_output=True)  # fmt: skip
    out = subprocess.run(
        [str(perplexity), "-m", str(model_path), *common, "--kl-divergence-base", str(base),
         "--kl-divergence"], check=True, capture_output=True, text=True,
    )  # fmt: skip
    log = out.stdout + out.stderr
    kl = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", log)
    same = re.search(r"Same top p:\s+([0-9.]+)", log)
    return {"kl": float(kl.group(1)) if kl else float("nan"),
            "top1": float(same.group(1)) / 100 if same else float("nan")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--isa", default="", help="TOKENMILL_ISA paths, comma-separated")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "kl-divergence")
    parser.add_argument("--json", action="store_true", help="print tokenmill's figures only")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(tokenmill_kl(args.model, args.text, args.ctx, args.chunks)))
        return
    from tokenmill.kernels import cpu_library
    from tokenmill.resolve import resolve_model

    rows = {f"tokenmill ({cpu_library.isa()})": tokenmill_kl(args.model, args.text, args.ctx,
                                                             args.chunks)}  # fmt: skip
    for isa in filter(None, args.isa.split(",")):
        cmd = [sys.executable, __file__, "--json", "--model", args.model, "--text", str(args.text),
               "--ctx", str(args.ctx), "--chunks", str(args.chunks)]  # fmt: skip
        env = {**os.environ, "TOKENMILL_ISA": isa}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        rows[f"tokenmill (TOKENMILL_ISA={isa})"] = json.loads(out.stdout.splitlines()[-1])
    if not args.no_llama_cpp:
        args.work.mkdir(parents=True, exist_ok=True)
        path = resolve_model(args.model).path
        rows["llama.cpp"] = llama_cpp_kl(path, args.text, args.ctx, args.chunks, args.work)
    print(f"{args.model}: {args.chunks} chunks of {args.ctx} tokens, the second halves scored")
    print("| | mean KL divergence | top-1 agreement |\n|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['kl']:.5f} | {r['top1']:.2%} |")


if __name__ == "__main__":
    main()
