"""The GGUF path end to end on tiny files written here: config from the metadata, tokenizer,
tensor renaming, llama.cpp's q/k row permutation (Llama) and 1 + w norms (Gemma 3), and F32,
F16, Q8_0, Q4_0 and Q4_K tensors, packed (the default) and dequantized (``quantization="none"``).

Oracle: transformers' model of the same config holding the weights the file stands for (each
tensor dequantized by the ``gguf`` package, the permutation and the + 1 undone). Compared on
prompt log-probs (the prompt token and the top 20 at every position, and the top 20 of the
token after it), absolute: at most 1e-4 with float32 activations (``quantization="none"``, and
packed with ``packed_activations="float32"``: the same weights, summed in another order); with
the packed default's int8 activations (each 32-element chunk of x rounded to 8 bits) at most
0.4 and 0.1 on average (measured: 0.31 and 0.05-0.09).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tokenmill.config import SLIDING_ATTENTION
from tokenmill.engine import LLMEngine
from tokenmill.kernels import cpu_library
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams

HIDDEN, INTERMEDIATE, NUM_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 64, 320
NUM_KV_HEADS = {"llama": 2, "gemma3": 1}
SLIDING_WINDOW = 8  # Gemma 3: shorter than the prompt, so the window matters
PROMPT_LEN = 24
TOP = 20
FLOAT_ATOL = (1e-4, 1e-4)  # (max, mean) |Δ log-prob|
INT8_ACT_ATOL = (0.4, 0.1)

# GGUF type of each 2-D tensor by its name (layer-less names, then per layer); every layer's
# q/k/v and gate/up mix formats differently, so fused and unfused projections are both loaded.
# Norms are F32 (as llama.cpp writes them).
GLOBAL_TYPES = {"token_embd": T.Q8_0, "output": T.Q4_0}
LAYER_TYPES = [
    {
        "attn_q": T.Q4_K,
        "attn_k": T.Q4_K,
        "attn_v": T.Q8_0,
        "attn_output": T.F16,
        "ffn_gate": T.Q8_0,
        "ffn_up": T.Q4_0,
        "ffn_down": T.Q4_K,
    },
    {
        "attn_q": T.Q4_0,
        "attn_k": T.Q4_0,
        "attn_v": T.Q4_0,
        "attn_output": T.Q4_0,
        "ffn_gate": T.Q4_K,
        "ffn_up": T.Q4_K,
        "ffn_down": T.Q8_0,
    },
]
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass
class TinyGGUF:
    path: Path
    hf_state: dict[str, torch.Tensor]  # the oracle's weights, by transformers' names


def _random_q4_k(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Valid Q4_K blocks (the ``gguf`` package cannot quantize to it): 144 bytes per 256
    weights, finite float16 super-block scale d and min dmin first, then random 6-bit scales and
    mins and 4-bit codes."""
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    d = rng.uniform(1e-4, 3e-4, size=(len(blocks), 2)).astype(np.float16)
    blocks[:, :4] = d.view(np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def _encode(rng: np.random.Generator, w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype == T.Q4_K:
        return _random_q4_k(rng, *w.shape)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def _decode(data: np.ndarray, qtype: T) -> np.ndarray:
    if qtype in (T.F32, T.F16):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, qtype)


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _tensor_shapes(arch: str, num_layers: int) -> dict[str, tuple[int, ...]]:
    kv = NUM_KV_HEADS[arch] * HEAD_DIM
    per_layer = {
        "attn_norm": (HIDDEN,),
        "attn_q": (NUM_HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, NUM_HEADS * HEAD_DIM),
        "ffn_norm": (HIDDEN,),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    if arch == "gemma3":
        per_layer |= {
            "attn_q_norm": (HEAD_DIM,),
            "attn_k_norm": (HEAD_DIM,),
            "post_attention_norm": (HIDDEN,),
            "post_ffw_norm": (HIDDEN,),
        }
    shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
    for layer in range(num_layers):
        shapes |= {f"blk.{layer}.{part}.weight": shape for part, shape in per_layer.items()}
    shapes["output_norm.weight"] = (HIDDEN,)
    if arch == "llama":  # Gemma ties its output head to the embedding
        shapes["output.weight"] = (VOCAB, HIDDEN)
    return shapes


def _hf_name(gguf_name: str, arch: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, part, _ = gguf_name.split(".")
    if part == "ffn_norm":
        hf = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    else:
        hf = HF_LAYER_NAMES[part]
    return f"model.layers.{layer}.{hf}.weight"


def random_reference(
    config: object, seed: int
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], np.random.Generator]:
    """transformers' float32 model of ``config`` (seeded), a copy of its state to replace with
    the weights a test file holds, and the generator that draws them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, state, np.random.default_rng(seed)


def finish_reference(
    writer: gguf.GGUFWriter, config: object, model: torch.nn.Module, state: dict
) -> torch.nn.Module:
    """Write the GGUF out; the reference model, eager, with the weights the file holds."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config._attn_implementation = "eager"  # type: ignore[attr-defined]
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A SentencePiece vocabulary of VOCAB pieces: specials, the 256 byte pieces, then single
    characters (no merges to recover)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [chr(0x4E00 + i) for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (VOCAB - 259)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)


def write_tiny_gguf(
    path: Path, arch: str, seed: int = 0, layer_types: list[dict[str, T]] = LAYER_TYPES
) -> TinyGGUF:
    """An ``arch`` GGUF of random weights, a layer per entry of ``layer_types``, and the float
    weights it stands for."""
    rng = np.random.default_rng(seed)
    num_kv = NUM_KV_HEADS[arch]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(len(layer_types))
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(num_kv)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 5e5)
    if arch == "gemma3":
        writer.add_sliding_window(SLIDING_WINDOW)
    _add_tokenizer(writer)
    hf_state = {}
    for name, shape in _tensor_shapes(arch, len(layer_types)).items():
        part = name.split(".")[-2]
        is_norm = len(shape) == 1
        if is_norm:  # near 1 as a multiplier: Gemma's (1 + w), Llama's w
            qtype = T.F32
            w = rng.normal(0.0 if arch == "gemma3" else 1.0, 0.1, size=shape).astype(np.float32)
        else:
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            qtype = GLOBAL_TYPES[part] if layer is None else layer_types[layer][part]
            w = rng.normal(0.0, 0.1, size=shape).astype(np.float32)
        # What the file stores: llama.cpp's conventions applied to the model's weight.
        if arch == "gemma3" and is_norm:
            w = w + 1.0
        if arch == "llama" and part in ("attn_q", "attn_k"):
            w = _permute(w, NUM_HEADS if part == "attn_q" else num_kv).reshape(shape)
        data = _encode(rng, w, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        # The oracle's weight: what the file holds, read back and the conventions undone.
        ref = _decode(data, qtype).reshape(shape)
        if arch == "gemma3" and is_norm:
            ref = ref - np.float32(1.0)
        if arch == "llama" and part in ("attn_q", "attn_k"):
            ref = _unpermute(ref, NUM_HEADS if part == "attn_q" else num_kv)
        hf_state[_hf_name(name, arch)] = torch.from_numpy(np.ascontiguousarray(ref))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, hf_state)


def _hf_model(arch: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS[arch],
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        config = tf.LlamaConfig(**common, rope_theta=5e5, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(config)
    else:
        config = tf.Gemma3TextConfig(
            **common,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=HEAD_DIM,
            hidden_activation="gelu_pytorch_tanh",
        )
        model = tf.Gemma3ForCausalLM(config)
    config._attn_implementation = "eager"
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if arch == "gemma3":
        model.tie_weights()
    return model.float().eval()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_gguf(request, tmp_path_factory) -> tuple[str, TinyGGUF, torch.nn.Module]:
    arch = request.param
    tiny = write_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf", arch)
    return arch, tiny, _hf_model(arch, tiny.hf_state)


def test_config_comes_from_the_metadata(tiny_gguf) -> None:
    arch, tiny, _ = tiny_gguf
    c = load_model_config(resolve_model(str(tiny.path)))
    assert c.architecture == arch
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (VOCAB, HIDDEN, INTERMEDIATE)
    assert (c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (2, NUM_HEADS, HEAD_DIM)
    assert c.num_key_value_heads == NUM_KV_HEADS[arch]
    assert c.rms_norm_eps == pytest.approx(1e-6)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.max_position_embeddings == 256
    if arch == "gemma3":
        assert c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
        assert (c.rope_theta, c.rope_local_theta) == (1e6, 10000.0)
        assert c.sliding_window == SLIDING_WINDOW
        assert c.layer_types == (SLIDING_ATTENTION, SLIDING_ATTENTION)  # globals every 6th
        assert c.attention_scale == pytest.approx(HEAD_DIM**-0.5)
    else:
        assert not c.tie_word_embeddings and c.hidden_act == "silu"
        assert c.rope_theta == 5e5 and c.sliding_window is None


@pytest.mark.parametrize(
    ("engine_args", "atol"),
    [
        ({"quantization": "none"}, FLOAT_ATOL),
        ({"packed_activations": "float32"}, FLOAT_ATOL),
        ({}, INT8_ACT_ATOL),
    ],
    ids=["dequantized", "packed-float32-act", "packed"],
)
def test_logprobs_match_transformers(tiny_gguf, engine_args, atol: tuple[float, float]) -> None:
    arch, tiny, hf = tiny_gguf
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN - 1)]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)  # row i predicts prompt[i + 1]
    engine = LLMEngine.from_args(
        model=str(tiny.path), max_model_len=64, kv_cache_memory="4MiB", **engine_args
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP, logprobs=TOP)
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    out = done[rid]
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == PROMPT_LEN and entries[0] is None
    diffs = []
    for pos in range(1, PROMPT_LEN):
        row = ref[pos - 1]
        entry = entries[pos]
        assert entry.sampled.token_id == prompt[pos]
        assert len(entry.top) == TOP
        diffs.append(entry.sampled.logprob - row[prompt[pos]].item())
        diffs += [alt.logprob - row[alt.token_id].item() for alt in entry.top]
    # The token after the prompt: sampled from the last prefill row.
    diffs += [alt.logprob - ref[-1, alt.token_id].item() for alt in out.outputs[0].logprobs[0].top]
    err = torch.tensor(diffs).abs()
    max_atol, mean_atol = atol
    assert err.max() <= max_atol and err.mean() <= mean_atol, (
        f"{arch} {engine_args}: |Δ log-prob| max {err.max():.2e}, mean {err.mean():.2e}"
    )
    # Random weights spread the log-probs: the comparison is not between two flat rows.
    assert ref.max(-1).values.mean() - ref.mean() > 1.0


def test_packed_parts_share_a_matmul_where_their_formats_allow(tiny_gguf) -> None:
    """Layer 0 mixes formats (q/k Q4_K beside a Q8_0 v; a Q8_0 gate beside a Q4_0 up): every
    part alone. Layer 1's q/k/v (Q4_0) and gate/up (Q4_K) each run as one matmul."""
    from tokenmill.models.loader import load_model
    from tokenmill.quant import PackedQuantMethod

    _, tiny, _ = tiny_gguf
    config = load_model_config(resolve_model(str(tiny.path)))
    model = load_model(config, torch.float32, torch.device("cpu"), 64, PackedQuantMethod())
    first, second = model.model.layers
    assert [g.parts for g in first.self_attn.qkv_proj.groups] == [("q",), ("k",), ("v",)]
    assert not first.mlp.gate_up_proj.is_fused
    assert second.self_attn.qkv_proj.is_fused and second.mlp.gate_up_proj.is_fused
    assert second.mlp.gate_up_proj.groups[0].state.weight.kind == "q4k"


def test_re_laid_parts_are_joined_without_a_copy(tiny_gguf, tmp_path: Path) -> None:
    """Q4_K parts of one matmul (a Q4_K_M layer's q/k/v and gate/up) are re-laid side by side at
    load, so joining them copies nothing (the joined weight is a view of the parts' tensor;
    without the C kernels, torch packs each part and the join copies), and the joined rows are
    what the torch re-lay (pack_gguf, then Llama's q/k rows unpermuted, then joined) gives."""
    from tokenmill.models.gguf_file import GGUFFile
    from tokenmill.models.loader import _iter_gguf, _unpermute_rope, load_model
    from tokenmill.quant import PackedQuantMethod
    from tokenmill.quant.packed import concat_rows, pack_gguf

    arch = tiny_gguf[0]
    types = {part: T.Q4_K for part in LAYER_TYPES[0]}
    tiny = write_tiny_gguf(tmp_path / "q4_k.gguf", arch, layer_types=[types])
    config = load_model_config(resolve_model(str(tiny.path)))
    model = load_model(config, torch.float32, torch.device("cpu"), 64, PackedQuantMethod())
    gguf = GGUFFile(tiny.path)
    rope = arch == "llama"  # llama.cpp permutes Llama's q/k rows; the loader undoes it

    def twin(name: str, heads: int = 0):
        tensor = next(t for t in gguf.tensors if t.name == f"blk.0.{name}.weight")
        raw = torch.frombuffer(bytearray(gguf.tensor_bytes(tensor)), dtype=torch.uint8)
        weight = pack_gguf(raw, tensor.ggml_type, tuple(tensor.shape))
        return _unpermute_rope(weight, heads) if heads and rope else weight

    loaded = dict(_iter_gguf(config, True, model.fused_weights(), model.checkpoint_name))
    for names in (("self_attn", "q", "k", "v"), ("mlp", "gate", "up")):
        parts = [loaded[f"model.layers.0.{names[0]}.{p}_proj.weight"] for p in names[1:]]
        joined = concat_rows(parts)
        relaid = cpu_library.available()  # then a view: nothing copied
        assert (joined.codes.data_ptr() == parts[0].codes.data_ptr()) == relaid
        assert (joined.scales.data_ptr() == parts[0].scales.data_ptr()) == relaid
    layer = model.model.layers[0]
    for fused, parts in (
        (
            layer.self_attn.qkv_proj,
            [twin("attn_q", NUM_HEADS), twin("attn_k", NUM_KV_HEADS[arch]), twin("attn_v")],
        ),
        (layer.mlp.gate_up_proj, [twin("ffn_gate"), twin("ffn_up")]),
    ):
        joined = fused.groups[0].state.weight
        expected = concat_rows(parts)
        assert torch.equal(joined.codes, expected.codes)
        assert torch.equal(joined.scales, expected.scales)
