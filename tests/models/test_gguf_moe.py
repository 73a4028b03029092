"""Mixtures of experts from GGUF: each family's tiny model written as llama.cpp's converter
writes it (stacked 3-D expert tensors ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp``
kept F32, Qwen2-MoE's ``*_shexp`` tensors; Mixtral as ``llama`` with its q/k rows permuted), with
the experts in F32, Q8_0 or Q4_K.

Oracle: transformers' model holding the weights the file stands for (every tensor decoded by the
``gguf`` package). Tolerances as tests/models/test_gguf_loading.py: 1e-4 with float32
activations (F32 experts computed as floats; packed ones with ``packed_activations="float32"``),
and with the packed default's int8 activations a dense model's (0.4, 0.1) for 95% of the
log-probs: rounding the activations can move a token across a near tie of the router, which
then runs another expert, so a few positions differ by more (measured: max 0.47-1.9, mean
0.03-0.05).
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
    INT8_ACT_ATOL,
    _add_tokenizer,
    _decode,
    _encode,
    _permute,
    _unpermute,
    finish_reference,
    random_reference,
)

from tokenmill.engine import LLMEngine
from tokenmill.models.loader import load_model_config
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams

HIDDEN, EXPERT, DENSE, NUM_HEADS, NUM_KV, HEAD_DIM, VOCAB = 256, 256, 512, 4, 2, 64, 320
NUM_EXPERTS, TOP_K, LAYERS = 8, 2, 2
PROMPT_LEN, TOP = 24, 20
ROUTING_FLIPS = 0.95  # the share of log-probs held to the int8 tolerance (see above)
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# transformers' module names (in memory: the experts as 3-D tensors) -> llama.cpp's.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def hf_config(arch: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=5e5,
        num_experts_per_tok=TOP_K,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=EXPERT, num_local_experts=NUM_EXPERTS)
    moe = dict(intermediate_size=DENSE, num_experts=NUM_EXPERTS, moe_intermediate_size=EXPERT)
    if arch == "qwen2_moe":  # layer 1 dense, a shared expert on layer 0
        return tf.Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=EXPERT, mlp_only_layers=[1]
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **moe, norm_topk_prob=True)
    return tf.OlmoeConfig(**common, intermediate_size=EXPERT, num_experts=NUM_EXPERTS)


def write_moe_gguf(
    path: Path, arch: str, expert_type: T, seed: int = 0, per_expert: bool = False
) -> torch.nn.Module:
    """A GGUF of random weights, and transformers' model of the weights it stands for.
    ``per_expert``: a 2-D tensor per expert (``blk.0.ffn_gate.3.weight``, older Mixtral files)
    instead of the stacks."""
    config = hf_config(arch)
    model, state, rng = random_reference(config, seed)
    float_only = expert_type == T.F32  # then every tensor is F32
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(EXPERT if arch in ("mixtral", "olmoe") else DENSE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(5e5)
    writer.add_expert_count(NUM_EXPERTS)
    writer.add_expert_used_count(TOP_K)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(EXPERT)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(EXPERT)
    _add_tokenizer(writer)

    def add(name: str, w: np.ndarray, qtype: T) -> np.ndarray:
        if float_only or w.ndim == 1 or name.split(".")[-2] == "ffn_gate_inp":
            qtype = T.F32  # norms, biases and routers: F32, as llama.cpp keeps them
        data = _encode(rng, w.reshape(-1, w.shape[-1]), qtype)
        data = data.reshape(*w.shape[:-1], data.shape[-1])  # a stack stays [E, N, ...]
        writer.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        return _decode(data, qtype).reshape(w.shape)

    def weight(name: str, scale: float = 0.1) -> np.ndarray:
        shape = state[name].shape
        if name.endswith("norm.weight"):
            return rng.normal(1.0, 0.1, size=shape).astype(np.float32)
        return rng.normal(0.0, scale, size=shape).astype(np.float32)

    for hf, gg in (("model.embed_tokens", "token_embd"), ("lm_head", "output")):
        state[f"{hf}.weight"] = torch.from_numpy(
            add(f"{gg}.weight", weight(f"{hf}.weight"), T.Q8_0)
        )
    state["model.norm.weight"] = torch.from_numpy(
        add("output_norm.weight", weight("model.norm.weight"), T.F32)
    )
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for name in [n for n in state if n.startswith(prefix)]:
            module, _, kind = name.removeprefix(prefix).rpartition(".")
            if module == "mlp.experts":  # transformers' [E, 2I, H] / [E, H, I]: stacked
                stacks = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                shape = state[name].shape
                rows = shape[1] // len(stacks)
                refs = []
                for proj in stacks:
                    w = rng.normal(0.0, 0.1, size=(shape[0], rows, shape[2])).astype(np.float32)
                    if not per_expert:
                        name_ = f"blk.{layer}.{EXPERT_NAMES[proj]}.weight"
                        refs.append(add(name_, w, expert_type))
                        continue
                    part = EXPERT_NAMES[proj].removesuffix("_exps")
                    refs.append(
                        np.stack(
                            [
                                add(f"blk.{layer}.{part}.{e}.weight", w[e], expert_type)
                                for e in range(shape[0])
                            ]
                        )
                    )
                state[name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(refs, 1)))
                continue
            w = weight(name)
            stored, heads = w, 0
            if arch == "mixtral" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = NUM_HEADS if module.endswith("q_proj") else NUM_KV
                stored = _permute(w, heads).reshape(w.shape)
            if module == "mlp.shared_expert_gate":
                stored = w.reshape(-1)  # llama.cpp's [H]
            ref = add(f"blk.{layer}.{LAYER_NAMES[module]}.{kind}", stored, T.Q8_0)
            ref = _unpermute(ref, heads) if heads else ref.reshape(w.shape)
            state[name] = torch.from_numpy(np.ascontiguousarray(ref))
    return finish_reference(writer, config, model, state)


_FILES: dict[tuple[str, T], tuple[Path, torch.nn.Module]] = {}


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    def make(arch: str, expert_type: T) -> tuple[Path, torch.nn.Module]:
        key = (arch, expert_type)
        if key not in _FILES:
            path = tmp_path_factory.mktemp("moe-gguf") / f"{arch}-{expert_type.name}.gguf"
            _FILES[key] = (path, write_moe_gguf(path, arch, expert_type))
        return _FILES[key]

    return make


ARCHS = list(GGUF_ARCH)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_comes_from_the_metadata(moe_gguf, arch) -> None:
    path, hf = moe_gguf(arch, T.Q8_0)
    c = load_model_config(resolve_model(str(path)))
    assert c.architecture == arch
    moe = c.moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (NUM_EXPERTS, TOP_K, EXPERT)
    assert moe.renormalize == (arch in ("mixtral", "qwen3_moe"))
    assert moe.sparse_layers == ((True, False) if arch == "qwen2_moe" else (True, True))
    assert moe.shared_intermediate_size == (EXPERT if arch == "qwen2_moe" else 0)
    assert c.qk_norm_full == (arch == "olmoe")
    assert c.attention_bias == (arch == "qwen2_moe")


def _prompt_logprob_errors(path: Path, hf: torch.nn.Module, **engine_args) -> torch.Tensor:
    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN - 1)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = LLMEngine.from_args(
        model=str(path), max_model_len=64, kv_cache_memory="4MiB", **engine_args
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    entries = done[rid].prompt_logprobs
    diffs = []
    for pos in range(1, PROMPT_LEN):
        assert entries[pos].sampled.token_id == prompt[pos]
        diffs.append(entries[pos].sampled.logprob - ref[pos - 1, prompt[pos]].item())
        diffs += [alt.logprob - ref[pos - 1, alt.token_id].item() for alt in entries[pos].top]
    assert_all_blocks_free(engine)
    assert ref.max(-1).values.mean() - ref.mean() > 1.0  # not two flat rows
    return torch.tensor(diffs).abs()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("expert_type", "engine_args", "atol"),
    [
        (T.F32, {}, FLOAT_ATOL),
        (T.Q8_0, {"packed_activations": "float32"}, FLOAT_ATOL),
        (T.Q8_0, {}, INT8_ACT_ATOL),
        (T.Q4_K, {"packed_activations": "float32"}, FLOAT_ATOL),
        (T.Q4_K, {}, INT8_ACT_ATOL),
        (T.Q4_K, {"quantization": "none"}, FLOAT_ATOL),
    ],
    ids=["f32", "q8_0-float-act", "q8_0", "q4_k-float-act", "q4_k", "q4_k-dequantized"],
)
def test_logprobs_match_transformers(moe_gguf, arch, expert_type, engine_args, atol) -> None:
    path, hf = moe_gguf(arch, expert_type)
    err = _prompt_logprob_errors(path, hf, **engine_args)
    bound = err.max() if atol == FLOAT_ATOL else err.quantile(ROUTING_FLIPS)
    assert bound <= atol[0] and err.mean() <= atol[1], (
        f"{arch} {expert_type.name} {engine_args}: max {err.max():.2e}, mean {err.mean():.2e}"
    )


@pytest.mark.parametrize("expert_type", [T.Q8_0, T.Q4_K])
def test_a_tensor_per_expert_loads_into_stacks(tmp_path, expert_type) -> None:
    """Older Mixtral GGUFs hold ``blk.N.ffn_gate.E.weight``: stacked at load, then the same."""
    path = tmp_path / "mixtral-per-expert.gguf"
    hf = write_moe_gguf(path, "mixtral", expert_type, per_expert=True)
    err = _prompt_logprob_errors(path, hf, packed_activations="float32")
    assert err.max() <= FLOAT_ATOL[0] and err.mean() <= FLOAT_ATOL[1]


def test_stacked_experts_stay_packed(moe_gguf) -> None:
    """Q4_K experts stay in their super-blocks ("q4k": the file's bytes; one stack a projection,
    gate joined with up)."""
    from tokenmill.moe import FusedMoE

    path, _ = moe_gguf("qwen3_moe", T.Q4_K)
    engine = LLMEngine.from_args(model=str(path), max_model_len=64, kv_cache_memory="4MiB")
    model = engine.executor.worker.model  # the uniprocess executor's
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == LAYERS
    for layer in layers:
        assert set(layer.packed) == {"gate_up", "down"}
        assert layer.packed["gate_up"].kind == "q4k"
        assert layer.packed["gate_up"].shape == (NUM_EXPERTS * 2 * EXPERT, HIDDEN)
        assert layer.gate_up is None and layer.down is None
