"""Hybrid linear-attention models from GGUF, each written as llama.cpp's converter writes it
(conversion/qwen.py), its matrices in Q8_0:

- Qwen3.5 (``qwen35``): linear attention as ``attn_qkv`` / ``attn_gate`` / ``ssm_beta`` /
  ``ssm_alpha`` / ``ssm_out``, value heads reordered from grouped to tiled (k0 k1 k0 k1 ..),
  A stored as −exp(A_log), the convolution's taps squeezed, norms as 1 + w.
- Qwen3-Next (``qwen3next``): the fused q/k/v/z split into ``attn_qkv`` and ``attn_gate`` by
  the converter, [b|a] kept interleaved per key head (``ssm_ba``), experts stacked with a
  gated shared expert.

Oracle: transformers' model holding the weights the file stands for (each tensor decoded by the
``gguf`` package, the converter's reorders undone); log-probs within 1e-4 (float32).
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
    finish_reference,
    random_reference,
)

from tokenmill.engine import LLMEngine
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 4, 2, 16, 4
NK, NV, DK, DV, TAPS = 2, 4, 16, 16, 4
PROMPT_LEN = 24
NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_ba": "ssm_ba",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def hf_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=512,
                  linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
                  linear_value_head_dim=DV, linear_conv_kernel_dim=TAPS, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5})  # fmt: skip
    if arch == "qwen35":
        return tf.Qwen3_5TextConfig(**common)
    return tf.Qwen3NextConfig(**common, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, shared_expert_intermediate_size=64,
                              mlp_only_layers=[1])  # fmt: skip


def _tile(w: np.ndarray, axis: int, head_dim: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's value-head reorder along ``axis``: grouped [k, group, d] -> tiled
    [group, k, d] (``inverse``: back)."""
    w = np.moveaxis(w, axis, 0)
    shape = (NV // NK, NK, head_dim) if inverse else (NK, NV // NK, head_dim)
    out = w.reshape(*shape, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.moveaxis(out, 0, axis)


def write_hybrid_gguf(path: Path, arch: str, seed: int = 0) -> torch.nn.Module:
    """A GGUF of random weights, and transformers' model of the weights it stands for."""
    config = hf_config(arch)
    model, state, rng = random_reference(config, seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM // 2)
    writer.add_ssm_conv_kernel(TAPS)
    writer.add_ssm_state_size(DK)
    writer.add_ssm_group_count(NK)
    writer.add_ssm_time_step_rank(NV)
    writer.add_ssm_inner_size(NV * DV)
    writer.add_full_attention_interval(4)
    if arch == "qwen3next":
        writer.add_expert_count(8)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(64)
        writer.add_expert_shared_feed_forward_length(64)
    _add_tokenizer(writer)
    tiled = arch == "qwen35"

    def add(name: str, w: np.ndarray) -> np.ndarray:
        """Write ``w`` (Q8_0 if a matrix whose rows take it, else F32): what it decodes to."""
        quantized = w.ndim >= 2 and w.shape[-1] % 32 == 0 and "gate_inp" not in name
        qtype = T.Q8_0 if quantized else T.F32
        data = _encode(rng, w, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
        return _decode(data, qtype).reshape(w.shape)

    def put(hf: str, gg: str, w: np.ndarray, store=lambda x: x, undo=lambda x: x) -> None:
        """Store ``store(w)`` as llama.cpp does; the oracle holds ``undo`` of what it decodes."""
        state[hf] = torch.from_numpy(np.ascontiguousarray(undo(add(gg, store(w))), np.float32))

    def random(name: str) -> np.ndarray:
        return rng.normal(0.0, 0.2 if state[name].dim() > 1 else 0.1, size=state[name].shape)

    plus_one = dict(store=lambda x: x + 1.0, undo=lambda x: x - 1.0)
    put("model.embed_tokens.weight", "token_embd.weight", random("model.embed_tokens.weight"))
    put("lm_head.weight", "output.weight", random("lm_head.weight"))
    put("model.norm.weight", "output_norm.weight", random("model.norm.weight"), **plus_one)
    for layer in range(LAYERS):
        prefix, blk = f"model.layers.{layer}.", f"blk.{layer}."
        for name in [n for n in state if n.startswith(prefix)]:
            module, _, kind = name.removeprefix(prefix).rpartition(".")
            w = random(name)
            if module == "linear_attn" and kind == "A_log":  # llama.cpp: A = −exp(A_log)
                opts = dict(store=lambda x: -np.exp(x), undo=lambda x: np.log(-x))
                if tiled:
                    opts = dict(store=lambda x: -np.exp(_tile(x, 0, 1)),
                                undo=lambda x: np.log(-_tile(x, 0, 1, True)))  # fmt: skip
                put(name, f"{blk}ssm_a", w, **opts)
            elif module == "linear_attn" and kind == "dt_bias":
                opts = dict(store=lambda x: _tile(x, 0, 1), undo=lambda x: _tile(x, 0, 1, True))
                put(name, f"{blk}ssm_dt.bias", w, **(opts if tiled else {}))
            elif module == "linear_attn.conv1d":  # [C, 1, K] -> [C, K]; v's channels tiled

                def store(x, tile=tiled):
                    x = x[:, 0, :]
                    return np.concatenate([x[: 2 * NK * DK], _tile(x[2 * NK * DK :], 0, DV)]) \
                        if tile else x  # fmt: skip

                def undo(x, tile=tiled):
                    if tile:
                        x = np.concatenate([x[: 2 * NK * DK], _tile(x[2 * NK * DK :], 0, DV, True)])
                    return x[:, None, :]

                put(name, f"{blk}ssm_conv1d.weight", w, store, undo)
            elif module == "linear_attn.in_proj_qkvz":  # the converter's split (no reorder)
                group = NV // NK
                heads = w.reshape(NK, 2 * DK + 2 * group * DV, HIDDEN)
                q, k, v, z = np.split(heads, np.cumsum([DK, DK, group * DV])[:3], axis=1)
                qkv = np.concatenate([t.reshape(-1, HIDDEN) for t in (q, k, v)])
                got_qkv = add(f"{blk}attn_qkv.weight", qkv)
                got_z = add(f"{blk}attn_gate.weight", z.reshape(-1, HIDDEN))
                qd = NK * DK
                parts = [got_qkv[:qd], got_qkv[qd : 2 * qd], got_qkv[2 * qd :], got_z]
                sizes = [DK, DK, group * DV, group * DV]
                fused = np.concatenate(
                    [p.reshape(NK, s, HIDDEN) for p, s in zip(parts, sizes)], axis=1
                ).reshape(w.shape)
                state[name] = torch.from_numpy(np.ascontiguousarray(fused, np.float32))
            elif module == "mlp.experts":  # stacked [E, 2I, H] -> gate and up, [E, H, I]
                if kind == "gate_up_proj":
                    half = w.shape[1] // 2
                    gate = add(f"{blk}ffn_gate_exps.weight", w[:, :half])
                    up = add(f"{blk}ffn_up_exps.weight", w[:, half:])
                    state[name] = torch.from_numpy(np.concatenate([gate, up], axis=1))
                else:
                    put(name, f"{blk}ffn_down_exps.weight", w)
            else:
                gg = f"{blk}{NAMES[module]}.{kind}"
                opts: dict = {}
                if module.endswith("norm") and module != "linear_attn.norm":
                    opts = plus_one
                elif module == "mlp.shared_expert_gate":  # llama.cpp's [H]
                    opts = dict(store=lambda x: x[0], undo=lambda x: x[None])
                elif tiled and module == "linear_attn.in_proj_qkv":
                    vd = 2 * NK * DK
                    opts = dict(
                        store=lambda x, vd=vd: np.concatenate([x[:vd], _tile(x[vd:], 0, DV)]),
                        undo=lambda x, vd=vd: np.concatenate([x[:vd], _tile(x[vd:], 0, DV, True)]),
                    )
                elif tiled and module in ("linear_attn.in_proj_z", "linear_attn.out_proj"):
                    axis = 1 if module.endswith("out_proj") else 0
                    opts = dict(store=lambda x, a=axis: _tile(x, a, DV),
                                undo=lambda x, a=axis: _tile(x, a, DV, True))  # fmt: skip
                elif tiled and module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
                    opts = dict(store=lambda x: _tile(x, 0, 1), undo=lambda x: _tile(x, 0, 1, True))
                put(name, gg, w, **opts)
    return finish_reference(writer, config, model, state)


@pytest.fixture(scope="module", params=["qwen35", "qwen3next"])
def hybrid_gguf(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    arch = request.param
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
    return arch, path, write_hybrid_gguf(path, arch)


def test_config_comes_from_the_metadata(hybrid_gguf) -> None:
    arch, path, _ = hybrid_gguf
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == {"qwen35": "qwen3_5", "qwen3next": "qwen3_next"}[arch]
    assert config.kv_layers == (3,) and config.linear_layers == (0, 1, 2)
    lin = config.linear_attention
    assert (lin.num_k_heads, lin.num_v_heads, lin.k_head_dim, lin.v_head_dim) == (NK, NV, DK, DV)
    assert lin.v_heads_tiled == (arch == "qwen35")
    assert config.rotary_dim == HEAD_DIM // 2 and config.attn_output_gate


@pytest.mark.parametrize(
    "engine_args", [{"quantization": "none"}, {"packed_activations": "float32"}],
    ids=["dequantized", "packed-float32-act"],
)  # fmt: skip
def test_logprobs_match_transformers(hybrid_gguf, engine_args) -> None:
    """Prompts chunked 10 tokens a step: the state carries across chunks and decodes."""
    arch, path, hf = hybrid_gguf
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN - 1)]
    engine = LLMEngine.from_args(model=str(path), max_model_len=64, kv_cache_memory="4MiB",
                                 max_num_batched_tokens=10, **engine_args)  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    out = done[rid].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + list(out.token_ids)])).logits[0].float()
    ref = torch.log_softmax(logits[PROMPT_LEN - 1 : -1], dim=-1)
    for pos, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.sampled.logprob == pytest.approx(ref[pos, tok].item(), abs=FLOAT_ATOL[0])
        assert ref[pos, tok].item() >= ref[pos].max().item() - FLOAT_ATOL[0]  # greedy
    assert_all_blocks_free(engine)
