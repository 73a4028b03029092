"""gpt-oss as its released files hold it: experts in MXFP4, from a Hugging Face checkpoint
(``*_blocks`` / ``*_scales``, gate and up interleaved) and from llama.cpp's GGUF (MXFP4
``ffn_{gate,up,down}_exps``, ``attn_sinks``, YaRN and window in the metadata).

Oracle: transformers' float gpt-oss holding the weights the files stand for (the experts
dequantized by the ``gguf`` package), compared on prompt and generated log-probs at 1e-4."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import _tiny_hf_config, assert_all_blocks_free, write_byte_tokenizer
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file
from test_gguf_loading import VOCAB, _add_tokenizer

from tokenmill.engine import LLMEngine
from tokenmill.models.gpt_oss import GptOssExperts
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams

PROMPT_LEN, TOP = 40, 5  # longer than the 24-token window


def _mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(llama.cpp's MXFP4 bytes [..., K/32 · 17], their float values) of w [..., K]."""
    data = gguf.quants.quantize(w.reshape(-1, w.shape[-1]), T.MXFP4)
    values = gguf.quants.dequantize(data, T.MXFP4).reshape(w.shape)
    return data.reshape(*w.shape[:-1], -1), values


def _hf_blocks(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's MXFP4 bytes as a Hugging Face checkpoint's blocks and scales."""
    blocks = data.reshape(*data.shape[:-1], -1, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # the 32 codes in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales


def _reference(seed: int, vocab: int, swiglu_limit: float | None = None):
    """transformers' tiny gpt-oss whose experts hold MXFP4-representable values, and those
    experts' MXFP4 bytes: gate_up [E, 2I rows, H] (interleaved) and down [E, H rows, I]."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _tiny_hf_config("gpt_oss")
    config.vocab_size = vocab
    if swiglu_limit is not None:
        config.swiglu_limit = swiglu_limit
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
    state = model.state_dict()
    packed = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for name in ("gate_up_proj", "down_proj"):
            rows = state[prefix + name].transpose(1, 2).numpy()  # [E, out, in]
            data, values = _mxfp4(np.ascontiguousarray(rows))
            state[prefix + name] = torch.from_numpy(values).transpose(1, 2).contiguous()
            packed[prefix + name] = data
    config._attn_implementation = "eager"
    model.load_state_dict(state)
    return model.eval(), state, packed


def _compare(path: Path, hf, vocab: int) -> None:
    rng = random.Random(5)
    prompt = [1] + [rng.randrange(3, vocab) for _ in range(PROMPT_LEN - 1)]
    engine = LLMEngine.from_args(model=str(path), max_model_len=128, kv_cache_memory="4MiB",
                                 packed_activations="float32")  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=TOP, logprobs=TOP,
                            ignore_eos=True)  # fmt: skip
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    out = done[rid]
    ids = prompt + list(out.outputs[0].token_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos in range(1, PROMPT_LEN):
        entry = out.prompt_logprobs[pos]
        assert entry.sampled.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
    for i, lp in enumerate(out.outputs[0].logprobs):
        pos = PROMPT_LEN + i
        assert lp.sampled.token_id == ids[pos]
        assert lp.sampled.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert ref[pos - 1, ids[pos]] >= ref[pos - 1].max() - 1e-4  # greedy
    assert_all_blocks_free(engine)
    # On a CPU the MXFP4 experts ran on the packed kernels (laid out exactly at load; each
    # expert's gate and up rows joined: one matmul).
    experts = [m for m in engine.executor.worker.model.modules() if isinstance(m, GptOssExperts)]
    assert experts and all(set(e.packed) == {"gate_up", "down"} for e in experts)


def test_a_hugging_face_mxfp4_checkpoint(tmp_path) -> None:
    hf, state, packed = _reference(seed=0, vocab=384)
    tensors = {k: v for k, v in state.items() if k not in packed}
    for name, data in packed.items():
        blocks, scales = _hf_blocks(data)
        tensors[f"{name}_blocks"] = torch.from_numpy(blocks)
        tensors[f"{name}_scales"] = torch.from_numpy(scales)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(tmp_path, 384)
    loaded = load_model_config(resolve_model(str(tmp_path)))
    assert loaded.moe is not None and loaded.moe.expert_format == "mxfp4"
    _compare(tmp_path, hf, 384)


def test_a_gguf(tmp_path) -> None:
    # llama.cpp fixes the experts' clamp at gpt-oss's 7 (its files do not carry it).
    hf, state, packed = _reference(seed=1, vocab=VOCAB, swiglu_limit=7.0)
    c = hf.config
    path = tmp_path / "tiny-gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    _add_tokenizer(writer)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.sinks": "attn_sinks", "mlp.router": "ffn_gate_inp"}  # fmt: skip
    f32 = {k: v.numpy().astype(np.float32) for k, v in state.items()}
    writer.add_tensor("token_embd.weight", f32["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", f32["model.norm.weight"])
    writer.add_tensor("output.weight", f32["lm_head.weight"])
    for layer in range(c.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf_name, gg in names.items():
            for kind in ("weight", "bias"):
                key = prefix + hf_name + (f".{kind}" if hf_name != "self_attn.sinks" else "")
                if key in f32 and (kind == "weight" or hf_name != "self_attn.sinks"):
                    writer.add_tensor(f"blk.{layer}.{gg}.{kind}", f32[key])
        experts = prefix + "mlp.experts."
        gate_up = packed[experts + "gate_up_proj"]  # [E, 2I, ...]: gate rows even, up odd
        for gg, data in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2]),
                         ("down", packed[experts + "down_proj"])):  # fmt: skip
            writer.add_tensor(f"blk.{layer}.ffn_{gg}_exps.weight", np.ascontiguousarray(data),
                              raw_dtype=T.MXFP4)  # fmt: skip
        bias = f32[experts + "gate_up_proj_bias"]
        writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
        writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
        writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", f32[experts + "down_proj_bias"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == "gpt_oss" and config.moe.expert_format == "mxfp4"
    assert config.layer_windows == (24, None) and config.rope_scaling.rope_type == "yarn"
    _compare(path, hf, VOCAB)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_config_without_layer_types_alternates_windows(tiny_model_dir, tmp_path) -> None:
    """Older gpt-oss configs list no layer_types: local and global layers alternate, local
    first, as transformers' default has them."""
    shutil.copytree(tiny_model_dir("gpt_oss"), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["layer_types"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    loaded = load_model_config(resolve_model(str(tmp_path / "m")))
    assert loaded.layer_windows == (24, None)
