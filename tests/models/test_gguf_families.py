"""The dense families added after Llama from GGUF: OLMo 2 (post-norms, q/k norms over all
heads), SmolLM3 (a NoPE layer every fourth, q/k rows permuted as for Llama), Phi-3 (fused
``attn_qkv`` and gate/up ``ffn_up``, LongRoPE's factors as tensors, partial rotary) and Gemma 2
(soft-capped attention scores and logits, alternating windows, norms stored as 1 + w), each
written as llama.cpp's converter writes it, with its projections in Q8_0.

Oracle: transformers' model of the same config holding the weights the file stands for (each
tensor decoded by the ``gguf`` package, the permutation undone). Compared on prompt log-probs
as tests/models/test_gguf_loading.py: 1e-4 with float32 activations.
"""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import assert_all_blocks_free
from gguf import GGMLQuantizationType as T
from test_gguf_loading import (
    FLOAT_ATOL,
    VOCAB,
    _add_tokenizer,
    _decode,
    _encode,
    _permute,
    finish_reference,
    random_reference,
)

from tokenmill.engine import LLMEngine
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV, HEAD_DIM = 256, 512, 4, 2, 64
PROMPT_LEN, TOP = 24, 20
LAYERS = {"olmo2": 2, "smollm3": 4, "phi3": 2, "gemma2": 2}
GEMMA2 = dict(sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
# Phi-3's LongRoPE on half of each head; the prompt stays within the original context.
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + i / 8 for i in range(16)],
        "long_factor": [2.0 + i / 4 for i in range(16)]}  # fmt: skip
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def hf_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS[arch], num_attention_heads=NUM_HEADS,
                  num_key_value_heads=NUM_KV, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    if arch == "olmo2":
        return tf.Olmo2Config(**common, rope_theta=5e5)
    if arch == "smollm3":
        return tf.SmolLM3Config(**common, rope_theta=5e5)
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                               rope_theta=10000.0, **GEMMA2)  # fmt: skip
    return tf.Phi3Config(**common, original_max_position_embeddings=256, rope_parameters=ROPE)


def write_family_gguf(path: Path, arch: str, seed: int = 0) -> torch.nn.Module:
    """A GGUF of random weights, and transformers' model of the weights it stands for."""
    config = hf_config(arch)
    model, state, rng = random_reference(config, seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS[arch])
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(5e5 if arch in ("olmo2", "smollm3") else 10000.0)
    if arch == "gemma2":
        writer.add_sliding_window(GEMMA2["sliding_window"])
        writer.add_attn_logit_softcapping(GEMMA2["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(GEMMA2["final_logit_softcapping"])
    if arch == "phi3":  # as llama.cpp's Phi3MiniModel writes it
        writer.add_rope_dimension_count(HEAD_DIM // 2)
        writer.add_rope_scaling_orig_ctx_len(256)
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(2) / np.log(256))))
        for kind in ("long", "short"):
            factors = np.array(ROPE[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    _add_tokenizer(writer)

    def add(name: str, w: np.ndarray) -> np.ndarray:
        qtype = T.Q8_0 if w.ndim == 2 else T.F32
        data = _encode(rng, w, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
        return _decode(data, qtype).reshape(w.shape)

    def weight(name: str) -> np.ndarray:
        shape = state[name].shape
        if name.endswith("norm.weight") and arch != "gemma2":
            return rng.normal(1.0, 0.1, size=shape).astype(np.float32)
        return rng.normal(0.0, 0.1, size=shape).astype(np.float32)

    def add_norm(name: str, w: np.ndarray) -> np.ndarray:
        """Gemma's norms: transformers' w, llama.cpp's 1 + w."""
        if arch != "gemma2":
            return add(name, w)
        return add(name, w + 1.0) - 1.0

    globals_ = (("model.embed_tokens", "token_embd"), ("lm_head", "output"),
                ("model.norm", "output_norm"))  # fmt: skip
    for hf, gg in globals_:
        put = add_norm if hf == "model.norm" else add
        state[f"{hf}.weight"] = torch.from_numpy(put(f"{gg}.weight", weight(f"{hf}.weight")))
    for layer in range(LAYERS[arch]):
        prefix = f"model.layers.{layer}."
        for name in [n for n in state if n.startswith(prefix)]:
            module, _, kind = name.removeprefix(prefix).rpartition(".")
            gg = LAYER_NAMES.get(module)
            if module == "post_attention_layernorm":  # OLMo 2's and Gemma's: after attention
                gg = "post_attention_norm" if arch in ("olmo2", "gemma2") else "ffn_norm"
            if module == "pre_feedforward_layernorm":  # Gemma's
                gg = "ffn_norm"
            w = weight(name)
            heads = {"self_attn.q_proj": NUM_HEADS, "self_attn.k_proj": NUM_KV}.get(module)
            if arch == "smollm3" and heads:  # llama.cpp's row order for its RoPE
                stored = _permute(w, heads).reshape(w.shape)
                ref = add(f"blk.{layer}.{gg}.{kind}", stored)
                ref = ref.reshape(heads, -1, 2, HIDDEN).swapaxes(1, 2).reshape(w.shape)
            elif module.endswith("norm"):
                ref = add_norm(f"blk.{layer}.{gg}.{kind}", w)
            else:
                ref = add(f"blk.{layer}.{gg}.{kind}", w)
            state[name] = torch.from_numpy(np.ascontiguousarray(ref))
    return finish_reference(writer, config, model, state)


@pytest.fixture(scope="module", params=sorted(LAYERS))
def family_gguf(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    arch = request.param
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
    return arch, path, write_family_gguf(path, arch)


def test_config_comes_from_the_metadata(family_gguf) -> None:
    arch, path, _ = family_gguf
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == arch
    if arch == "smollm3":  # llama.cpp's rule: every fourth layer has no RoPE
        assert config.rope_layers == (True, True, True, False)
    if arch == "olmo2":
        assert config.qk_norm_full
    if arch == "gemma2":
        assert config.attn_logit_softcapping == 2.0 and config.final_logit_softcapping == 5.0
        assert config.layer_windows == (8, None)
    if arch == "phi3":
        assert config.rotary_dim == HEAD_DIM // 2
        scaling = config.rope_scaling
        assert scaling is not None and scaling.rope_type == "longrope"
        assert scaling.long_factor == tuple(ROPE["long_factor"])
        assert scaling.original_max_position_embeddings == 256


@pytest.mark.parametrize(
    "engine_args", [{"quantization": "none"}, {"packed_activations": "float32"}],
    ids=["dequantized", "packed-float32-act"],
)  # fmt: skip
def test_logprobs_match_transformers(family_gguf, engine_args) -> None:
    arch, path, hf = family_gguf
    assert_logprobs_match(path, hf, engine_args, arch)


def assert_logprobs_match(
    path: Path,
    hf: torch.nn.Module,
    engine_args: dict,
    label: str,
    atol: tuple[float, float] = FLOAT_ATOL,
) -> None:
    """A GGUF's prompt log-probs (top TOP) and 4 greedy tokens' log-probs equal transformers'
    model holding the weights it stands for, within ``atol`` (max, mean; test_gguf_gemma4.py
    too)."""
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN - 1)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = LLMEngine.from_args(
        model=str(path), max_model_len=64, kv_cache_memory="4MiB", **engine_args
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP, logprobs=TOP,
                            ignore_eos=True)  # fmt: skip
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    entries = done[rid].prompt_logprobs
    diffs = []
    for pos in range(1, PROMPT_LEN):
        row, entry = ref[pos - 1], entries[pos]
        assert entry.sampled.token_id == prompt[pos]
        diffs.append(entry.sampled.logprob - row[prompt[pos]].item())
        diffs += [alt.logprob - row[alt.token_id].item() for alt in entry.top]
    err = torch.tensor(diffs).abs()
    assert err.max() <= atol[0] and err.mean() <= atol[1], (label, err.max())
    # Decode steps too: the generated tokens' log-probs, against transformers on the whole.
    out = done[rid].outputs[0]
    with torch.no_grad():
        full = hf(torch.tensor([prompt + list(out.token_ids)])).logits[0].float()
    ref_out = torch.log_softmax(full[PROMPT_LEN - 1 : -1], dim=-1)
    for pos, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.sampled.logprob == pytest.approx(ref_out[pos, tok].item(), abs=atol[0])
    assert_all_blocks_free(engine)
