"""Reading a checkpoint's configuration into ModelConfig: a Hugging Face config.json
(``config_from_hf``) or a GGUF's metadata (``config_from_gguf``). The one place where
checkpoint quirks (key names, rope layouts, per-family defaults) are absorbed; everything
downstream reads plain fields. Which names are supported is architectures.py's."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from tokenmill.architectures import (
    BY_NAME,
    GGUF_ARCHITECTURES,
    HF_MODEL_TYPES,
    HYBRID_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
)
from tokenmill.config.model import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    LinearAttentionConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
)
from tokenmill.modelfile import GGUF_FILE_TYPES
from tokenmill.resolve import ModelSource

logger = logging.getLogger(__name__)


def config_from_hf(model_dir: Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (transformers 4 or 5 key layout)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if "text_config" in cfg:  # multimodal wrapper (e.g. Gemma3ForConditionalGeneration)
        cfg = {**cfg["text_config"], "eos_token_id": cfg.get("eos_token_id")}
    model_type = cfg.get("model_type", "")
    arch = HF_MODEL_TYPES.get(model_type)
    if arch is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {model_dir / 'config.json'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = cfg["hidden_size"]
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // num_heads
    num_layers = cfg["num_hidden_layers"]
    rope_theta, rope_scaling, rope_local = _hf_rope(cfg, head_dim)
    sliding_window = cfg.get("sliding_window")
    layer_types = tuple(cfg.get("layer_types") or ())
    if arch == "gemma3":
        if not layer_types:
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern", 6)
            layer_types = _gemma3_layer_types(num_layers, pattern)
    elif arch == "gemma2":  # local and global layers alternate, local first
        layer_types = layer_types or _gemma3_layer_types(num_layers, 2)
        rope_local = rope_theta
    elif arch == "gemma4":  # as Gemma 3's; transformers makes the last layer global
        layer_types = layer_types or _gemma3_layer_types(num_layers, 6)
        layer_types = layer_types[:-1] + (FULL_ATTENTION,)
    elif arch == "gpt_oss":  # as Gemma 2's, where its config does not list them
        layer_types = layer_types or _gemma3_layer_types(num_layers, 2)
    elif arch in ("mistral", "mixtral", "phi3"):
        layer_types = (SLIDING_ATTENTION if sliding_window else FULL_ATTENTION,) * num_layers
    elif arch == "smollm3":
        if not cfg.get("use_sliding_window", False):
            sliding_window = None
    elif arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window", False):
            sliding_window = None
            layer_types = (FULL_ATTENTION,) * num_layers
    else:
        sliding_window = None
        layer_types = (FULL_ATTENTION,) * num_layers
    if sliding_window is None:
        layer_types = (FULL_ATTENTION,) * num_layers
    linear_attention = None
    if arch in HYBRID_ARCHITECTURES:
        layer_types, linear_attention = _hf_linear_attention(cfg, arch, num_layers)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        geos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if geos is not None:
            extra = tuple(geos) if isinstance(geos, list) else (geos,)
            eos_ids = tuple(dict.fromkeys(eos_ids + extra))
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP: its experts' width stands in.
        intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_local_theta=rope_local if arch in ("gemma2", "gemma3", "gemma4") else None,
        sliding_window=sliding_window,
        layer_types=layer_types,
        tie_word_embeddings=cfg.get(
            "tie_word_embeddings", arch in ("gemma2", "gemma3", "gemma4")
        ),  # Gemma ties by default
        attention_bias=bool(cfg.get("attention_bias", arch in ("qwen2", "qwen2_moe"))),
        # Qwen2's bias stops at q/k/v; gpt-oss's goes on to the output projection.
        o_proj_bias=arch == "gpt_oss" and bool(cfg.get("attention_bias", True)),
        attention_sinks=arch == "gpt_oss",
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        # Gemma 4 scales its (normalized) queries by 1, not by head_dim^-0.5.
        query_pre_attn_scalar=1.0 if arch == "gemma4" else cfg.get("query_pre_attn_scalar"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "gemma2" else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=_hf_moe(cfg, arch, num_layers),
        qk_norm_full=arch in ("olmoe", "olmo2"),
        clip_qkv=cfg.get("clip_qkv"),
        rotary_dim=_hf_rotary_dim(cfg, head_dim),
        # SmolLM3's no_rope_layers: 1 where a layer rotates, 0 where it does not.
        rope_layers=tuple(bool(x) for x in cfg.get("no_rope_layers") or ()),
        linear_attention=linear_attention,
        attn_output_gate=arch in HYBRID_ARCHITECTURES and bool(cfg.get("attn_output_gate", True)),
        **_hf_weight_format(cfg, model_dir),
        **(_hf_gemma4(cfg, layer_types) if arch == "gemma4" else {}),
        source=ModelSource(model_dir, "hf"),
    )


def config_from_gguf(
    path: Path,
    metadata: dict[str, Any],
    tensor_names: set[str],
    rope_factors: dict[str, tuple[float, ...]] | None = None,
    tensor_types: dict[str, int] | None = None,
) -> ModelConfig:
    """Build from GGUF metadata (``{key: value}``) as llama.cpp's converter writes it.
    ``rope_factors``: the file's ``rope_factors_short`` / ``_long`` tensors (Phi-3's LongRoPE
    keeps them there), by those names; ``tensor_types``: each tensor's GGML type (gpt-oss's
    experts may be MXFP4); None where they were not read (a memory estimate)."""
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (llama also Mistral, and Mixtral with experts)"
        )
    arch = GGUF_ARCHITECTURES[gguf_arch]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{gguf_arch}.{key}", default)

    per_layer: dict[str, list[Any]] = {}
    if gguf_arch == "gemma4":  # per-layer arrays: the checks below read the first layer's
        for key in ("attention.head_count_kv", "feed_forward_length"):
            if isinstance(get(key), list) and get(key):
                per_layer[key] = get(key)
                metadata = {**metadata, f"{gguf_arch}.{key}": get(key)[0]}
    # NOTE: checked before any use: a missing key was a TypeError, and a layer count the
    # tensors do not back (a billion) builds the layers before the first weight is read.
    for key in ("block_count", "embedding_length", "attention.head_count"):
        value = get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{path}: GGUF metadata {gguf_arch}.{key} must be a positive integer; got {value!r}"
            )
    for key in ("attention.head_count_kv", "attention.key_length", "vocab_size"):
        value = get(key)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(
                f"{path}: GGUF metadata {gguf_arch}.{key} must be a positive integer; got {value!r}"
            )
    if get("attention.head_count") % get("attention.head_count_kv", 1):
        raise ValueError(
            f"{path}: {gguf_arch}.attention.head_count ({get('attention.head_count')}) is "
            f"not a multiple of attention.head_count_kv ({get('attention.head_count_kv')})"
        )
    if not metadata.get("tokenizer.ggml.tokens") and get("vocab_size") is None:
        raise ValueError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens nor vocab_size")
    if not isinstance(get("feed_forward_length"), int):
        raise ValueError(f"{path}: GGUF metadata lacks {gguf_arch}.feed_forward_length")
    layers = {n.split(".")[1] for n in tensor_names if n.startswith("blk.")}
    num_layers = get("block_count")
    if len(layers) != num_layers or layers != {str(i) for i in range(num_layers)}:
        raise ValueError(
            f"{path}: {gguf_arch}.block_count is {num_layers}, but the file has "
            f"tensors for {len(layers)} layers"
        )
    num_layers = int(get("block_count"))
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // num_heads)
    num_kv = get("attention.head_count_kv", num_heads)
    vocab = len(metadata.get("tokenizer.ggml.tokens") or []) or int(get("vocab_size"))
    sliding_window = get("attention.sliding_window")
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        token_id = metadata.get(key)
        if token_id is not None and not 0 <= token_id < vocab:
            raise ValueError(
                f"{path}: GGUF metadata {key} is {token_id}, outside the vocabulary of "
                f"{vocab} tokens"
            )
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        moe=_gguf_moe(get, arch, num_layers, tensor_names),
        file_type=GGUF_FILE_TYPES.get(metadata.get("general.file_type", -1)),
        source=ModelSource(path, "gguf"),
    )
    if gguf_arch == "gemma4":
        return _gguf_gemma4(path, get, per_layer, tensor_names, rope_factors, common)
    if gguf_arch == "gemma3":
        # NOTE: llama.cpp does not store the local RoPE base (10000) nor the 5:1 local/global
        # pattern; both are fixed by the Gemma 3 architecture.
        return ModelConfig(
            architecture="gemma3",
            rope_local_theta=10000.0,
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=_gemma3_layer_types(num_layers, 6),
            hidden_act="gelu_pytorch_tanh",
            # Gemma 3 27B scales queries by hidden/heads, the others by head_dim.
            query_pre_attn_scalar=hidden // num_heads if num_layers == 62 else head_dim,
            **common,
        )
    if gguf_arch == "gemma2":
        return ModelConfig(
            architecture="gemma2",
            rope_local_theta=common["rope_theta"],
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=_gemma3_layer_types(num_layers, 2),
            hidden_act="gelu_pytorch_tanh",
            # Gemma 2 27B scales queries by hidden/heads, the others by head_dim (llama.cpp).
            query_pre_attn_scalar=hidden // num_heads if num_layers == 46 else head_dim,
            attn_logit_softcapping=get("attn_logit_softcapping"),
            final_logit_softcapping=get("final_logit_softcapping"),
            **common,
        )
    if gguf_arch == "gpt-oss":
        assert common["moe"] is not None
        expert_type = (tensor_types or {}).get("blk.0.ffn_gate_exps.weight")
        # NOTE: llama.cpp fixes the clamp at 7, YaRN's betas at 32 and 1 (untruncated, as
        # gpt-oss's config has them), and local layers first, alternating.
        moe = dataclasses.replace(common.pop("moe"), swiglu_limit=7.0,
                                  expert_format="mxfp4" if expert_type == 39 else "float")  # fmt: skip
        if get("rope.scaling.type") == "yarn":
            factor = float(get("rope.scaling.factor", 1.0))
            common["rope_scaling"] = RopeScaling(
                rope_type="yarn",
                factor=factor,
                original_max_position_embeddings=int(
                    get("rope.scaling.original_context_length", 4096)
                ),
                attention_factor=0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0,
                truncate=False,
            )
        return ModelConfig(
            architecture="gpt_oss",
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=_gemma3_layer_types(num_layers, 2),
            attention_bias=True,
            o_proj_bias=True,
            attention_sinks=True,
            moe=moe,
            **common,
        )
    if arch in HYBRID_ARCHITECTURES:
        return _gguf_hybrid(path, arch, gguf_arch, get, common)
    if arch == "llama" and common["moe"] is not None:
        arch = "mixtral"
    if arch in ("llama", "mixtral") and sliding_window:
        return ModelConfig(
            architecture="mistral" if arch == "llama" else arch,
            sliding_window=int(sliding_window),
            layer_types=(SLIDING_ATTENTION,) * num_layers,
            **common,
        )
    if arch == "phi3":
        rope_dims = get("rope.dimension_count")
        if isinstance(rope_dims, int) and 0 < rope_dims < head_dim:
            common["rotary_dim"] = rope_dims
        if rope_factors and "rope_factors_long" in rope_factors:
            original = int(get("rope.scaling.original_context_length") or common[
                "max_position_embeddings"])  # fmt: skip
            common["rope_scaling"] = RopeScaling(
                rope_type="longrope",
                factor=common["max_position_embeddings"] / original,
                original_max_position_embeddings=original,
                short_factor=rope_factors["rope_factors_short"],
                long_factor=rope_factors["rope_factors_long"],
                attention_factor=float(get("rope.scaling.attn_factor", 1.0)),
            )
        if sliding_window:  # every layer, as transformers' Phi-3 has it
            common |= dict(sliding_window=int(sliding_window),
                           layer_types=(SLIDING_ATTENTION,) * num_layers)  # fmt: skip
    if arch == "smollm3":
        # NOTE: llama.cpp fixes SmolLM3's NoPE layers at every fourth (its converter keeps no
        # no_rope_layers), as the released models have them.
        common["rope_layers"] = tuple((i + 1) % 4 != 0 for i in range(num_layers))
    return ModelConfig(
        architecture=arch,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm_full=arch in ("olmoe", "olmo2"),
        **common,
    )


def _hf_linear_attention(
    cfg: dict[str, Any], arch: str, num_layers: int
) -> tuple[tuple[str, ...], LinearAttentionConfig]:
    """(layer types, the Gated DeltaNet layers' shape) of a hybrid model; its configs list the
    layer types, or give every ``full_attention_interval``-th layer full attention."""
    layer_types = tuple(cfg.get("layer_types") or ())
    if not layer_types:
        every = int(cfg.get("full_attention_interval", 4))
        layer_types = tuple(
            FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(num_layers)
        )
    unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"{arch}: layer_types must give {num_layers} layers of "
                         f"{FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}; got {layer_types}")  # fmt: skip
    linear = LinearAttentionConfig(
        num_k_heads=int(cfg["linear_num_key_heads"]),
        num_v_heads=int(cfg["linear_num_value_heads"]),
        k_head_dim=int(cfg["linear_key_head_dim"]),
        v_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(f"{arch}: linear_num_value_heads ({linear.num_v_heads}) must be a "
                         f"multiple of linear_num_key_heads ({linear.num_k_heads})")  # fmt: skip
    return layer_types, linear


def _gguf_hybrid(
    path: Path, arch: str, gguf_arch: str, get: Any, common: dict[str, Any]
) -> ModelConfig:
    """A hybrid model from llama.cpp's keys: the linear-attention layers' shape from its
    ``ssm.*`` keys, which layers they are from ``attention.recurrent_layers`` (else every
    ``full_attention_interval``-th layer attends fully), RoPE's rotated width."""
    num_layers = common["num_hidden_layers"]
    for key in ("ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size"):
        value = get(key)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}: GGUF metadata {gguf_arch}.{key} must be a positive "
                             f"integer; got {value!r}")  # fmt: skip
    num_v = int(get("ssm.time_step_rank"))
    linear = LinearAttentionConfig(
        num_k_heads=int(get("ssm.group_count")),
        num_v_heads=num_v,
        k_head_dim=int(get("ssm.state_size")),
        v_head_dim=int(get("ssm.inner_size")) // num_v,
        conv_kernel=int(get("ssm.conv_kernel", 4)),
        # llama.cpp's Qwen3.5 converter reorders value heads for its broadcasts (Qwen3-Next's
        # does not).
        v_heads_tiled=gguf_arch in ("qwen35", "qwen35moe"),
    )
    recurrent = get("attention.recurrent_layers")
    if recurrent is not None:
        layer_types = tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent)
    else:
        every = int(get("full_attention_interval", 4))
        layer_types = tuple(
            FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(num_layers)
        )
    if len(layer_types) != num_layers:
        raise ValueError(f"{path}: {gguf_arch}.attention.recurrent_layers has "
                         f"{len(layer_types)} entries for {num_layers} layers")  # fmt: skip
    rope_dims = get("rope.dimension_count")
    if isinstance(rope_dims, int) and 0 < rope_dims < common["head_dim"]:
        common["rotary_dim"] = rope_dims
    return ModelConfig(
        architecture=arch,
        layer_types=layer_types,
        linear_attention=linear,
        attn_output_gate=True,
        **common,
    )


def _hf_moe(cfg: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The sparse MLPs of a Hugging Face config (None for a dense architecture)."""
    if arch == "gemma4":  # experts beside every layer's dense MLP (models/gemma4.py)
        if not cfg.get("enable_moe_block"):
            return None
        return MoEConfig(
            num_experts=int(cfg["num_experts"]),
            top_k=int(cfg["top_k_experts"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            renormalize=True,
            sparse_layers=(True,) * num_layers,
        )
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_next",
                    "qwen3_5_moe"):  # fmt: skip
        return None
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if arch in ("mixtral", "gpt_oss"):  # every layer sparse, a softmax over the top k
        step, dense_only, renormalize = 1, (), True
    else:
        step = cfg.get("decoder_sparse_step") or 1
        dense_only = tuple(cfg.get("mlp_only_layers") or ())
        # Qwen3.5-MoE always renormalizes (its config has no key for it).
        renormalize = bool(cfg.get("norm_topk_prob", arch == "qwen3_5_moe"))
    sparse = tuple(
        i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
    )
    return MoEConfig(
        num_experts=int(num_experts),
        top_k=int(cfg["num_experts_per_tok"]),
        # Mixtral's experts are intermediate_size wide; Qwen's and OLMoE's dense layers are.
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        renormalize=renormalize,
        sparse_layers=sparse,
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if arch == "gpt_oss" else None,
        # gpt-oss's released checkpoints keep their experts in MXFP4 (``*_blocks``/``_scales``).
        expert_format=(
            "mxfp4"
            if (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
            else "float"
        ),
    )


def _gguf_moe(get: Any, arch: str, num_layers: int, tensor_names: set[str]) -> MoEConfig | None:
    """The sparse MLPs of a GGUF (llama.cpp's ``expert_*`` keys); a layer is sparse where its
    expert tensors are: stacked, or one per expert (older Mixtral files)."""
    num_experts = int(get("expert_count", 0) or 0)
    if num_experts == 0:
        if arch in ("qwen2_moe", "qwen3_moe", "olmoe"):
            raise ValueError(f"GGUF architecture {arch!r} without expert_count")
        return None
    sparse = tuple(
        f"blk.{i}.ffn_gate_exps.weight" in tensor_names
        or f"blk.{i}.ffn_gate.0.weight" in tensor_names
        for i in range(num_layers)
    )
    norm = get("expert_weights_norm")
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(get("expert_used_count")),
        intermediate_size=int(get("expert_feed_forward_length") or get("feed_forward_length")),
        renormalize=bool(BY_NAME[arch].gguf_norm_topk) if norm is None else bool(norm),
        sparse_layers=sparse,
        shared_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
    )


def _hf_gemma4(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, Any]:
    """Gemma 4's fields (transformers' Gemma4TextConfig): the global layers' head width and KV
    heads, k = v, per-layer embeddings, and which layers attend with an earlier layer's K/V
    (``kv_sharing_modes``: from ``num_kv_shared_layers`` before the end, each layer reads the
    last layer of its kind before them)."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with use_bidirectional_attention 'all' is not supported yet")
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    num_shared = int(cfg.get("num_kv_shared_layers") or 0)
    sources = _gemma4_kv_sources(layer_types, num_shared)
    # The global layers' shape: Google's keys, or transformers' per_layer_config as it saves
    # them (a {head_dim, num_key_value_heads} override per global layer).
    global_head_dim = int(cfg.get("global_head_dim") or 512)
    # transformers reads num_global_key_value_heads only where attention_k_eq_v is set.
    global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
    overrides = cfg.get("per_layer_config")
    if overrides is not None:
        shapes = {tuple(sorted(o.items())) for o in overrides.values()}
        globals_ = {i for i, t in enumerate(layer_types) if t == FULL_ATTENTION}
        if {int(i) for i in overrides} != globals_ or len(shapes) != 1:
            raise ValueError(
                "Gemma 4 with per-layer overrides other than one shape for every global layer "
                "is not supported yet"
            )
        override = dict(shapes.pop())
        if set(override) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"Gemma 4 with per-layer {sorted(override)} is not supported yet")
        global_head_dim = int(override.get("head_dim", cfg.get("head_dim")))
        global_kv = override.get("num_key_value_heads")
    return {
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv,
        "attention_k_eq_v": k_eq_v,
        "hidden_size_per_layer_input": int(cfg.get("hidden_size_per_layer_input") or 0),
        "vocab_size_per_layer_input": int(cfg.get("vocab_size_per_layer_input") or 0),
        "kv_source_layers": sources,
        "double_wide_mlp": bool(cfg.get("use_double_wide_mlp", False)) and num_shared > 0,
    }


def _gemma4_kv_sources(layer_types: tuple[str, ...], num_shared: int) -> tuple[int, ...]:
    """Each layer's K/V source (``ModelConfig.kv_source_layers``; () without sharing): from
    ``num_shared`` layers before the end, a layer reads the last layer of its kind before them
    (transformers' rule)."""
    if not num_shared:
        return ()
    first_shared = len(layer_types) - num_shared
    producers = {t: i for i, t in enumerate(layer_types[:first_shared])}  # the last of each
    if first_shared <= 0 or set(producers) != set(layer_types):
        raise ValueError(
            "Gemma 4's num_kv_shared_layers leaves a kind of layer with no layer before the "
            "shared ones to keep its K/V"
        )
    return tuple(i if i < first_shared else producers[t] for i, t in enumerate(layer_types))


def _gguf_gemma4(
    path: Path,
    get: Any,
    per_layer: dict[str, list[Any]],
    tensor_names: set[str],
    rope_factors: dict[str, tuple[float, ...]] | None,
    common: dict[str, Any],
) -> ModelConfig:
    """Gemma 4 from llama.cpp's keys (its converter's Gemma4Model): the window pattern as one
    bool per layer, the global layers' head width as ``key_length`` (the window layers' as
    ``key_length_swa``), KV heads and MLP widths per layer where they differ, k = v where a
    global layer has no ``attn_v``, and proportional RoPE as the ``rope_freqs`` tensor (1 for
    a turning pair, 1e30 for one standing still)."""
    num_layers, num_kv = common["num_hidden_layers"], common["num_key_value_heads"]
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(f"{path}: gemma4.attention.sliding_window_pattern must list "
                         f"{num_layers} layers; got {pattern!r}")  # fmt: skip
    layer_types = tuple(SLIDING_ATTENTION if swa else FULL_ATTENTION for swa in pattern)
    global_head_dim = common["head_dim"]  # key_length: the global layers'
    head_dim = get("attention.key_length_swa")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"{path}: gemma4.attention.key_length_swa must be a positive integer; "
                         f"got {head_dim!r}")  # fmt: skip
    for key, expected in (("attention.value_length", global_head_dim),
                          ("attention.value_length_swa", head_dim),
                          ("rope.dimension_count", global_head_dim),
                          ("rope.dimension_count_swa", head_dim)):  # fmt: skip
        if get(key, expected) != expected:  # llama.cpp's own requirements, and no partial RoPE
            raise ValueError(f"{path}: Gemma 4 with gemma4.{key} {get(key)} (not {expected}) "
                             "is not supported")  # fmt: skip
    if common["rope_scaling"] is not None:
        raise ValueError(f"{path}: Gemma 4 with rope.scaling.type {get('rope.scaling.type')!r} "
                         "is not supported")  # fmt: skip
    if any(n.endswith(".attn_qkv.weight") for n in tensor_names):
        raise ValueError(f"{path}: Gemma 4 with fused attn_qkv tensors is not supported")
    num_shared = int(get("attention.shared_kv_layers", 0) or 0)
    sources = _gemma4_kv_sources(layer_types, num_shared)
    first_shared = num_layers - num_shared
    # KV heads per layer: the global layers' may be fewer.
    kv_heads = per_layer.get("attention.head_count_kv", [num_kv] * num_layers)
    global_kv = {kv_heads[i] for i, t in enumerate(layer_types) if t == FULL_ATTENTION}
    local_kv = {kv_heads[i] for i, t in enumerate(layer_types) if t == SLIDING_ATTENTION}
    if len(kv_heads) != num_layers or len(global_kv) > 1 or len(local_kv) > 1:
        raise ValueError(f"{path}: Gemma 4 with KV heads {kv_heads} (one count for the window "
                         "layers, one for the global ones) is not supported")  # fmt: skip
    num_kv = local_kv.pop() if local_kv else num_kv
    # k = v: the global layers that keep K/V have no attn_v.
    has_v = {f"blk.{i}.attn_v.weight" in tensor_names for i in range(first_shared)
             if layer_types[i] == FULL_ATTENTION}  # fmt: skip
    local_has_v = all(f"blk.{i}.attn_v.weight" in tensor_names for i in range(first_shared)
                      if layer_types[i] == SLIDING_ATTENTION)  # fmt: skip
    if len(has_v) > 1 or not local_has_v:
        raise ValueError(f"{path}: Gemma 4 with attn_v on some global (or no window) layers "
                         "is not supported")  # fmt: skip
    # MLP widths per layer: twice as wide on the KV-sharing layers (use_double_wide_mlp).
    widths = per_layer.get("feed_forward_length", [common["intermediate_size"]] * num_layers)
    width = widths[0]
    double_wide = len(set(widths)) > 1
    expected = [width * (2 if double_wide and i >= first_shared else 1) for i in range(num_layers)]
    if list(widths) != expected:
        raise ValueError(f"{path}: Gemma 4 with MLP widths {widths} is not supported (one "
                         "width, doubled on the KV-sharing layers)")  # fmt: skip
    # Proportional RoPE on the global layers: the pairs of factor 1 turn, those of 1e30 not.
    rope_scaling = None
    freqs = (rope_factors or {}).get("rope_freqs")
    if freqs is not None:
        turning = sum(f == 1.0 for f in freqs)
        partial = 2 * turning / global_head_dim
        if (
            len(freqs) != global_head_dim // 2
            or any(f != 1.0 for f in freqs[:turning])
            or any(f < 1e29 for f in freqs[turning:])
            or int(partial * global_head_dim // 2) != turning
        ):
            raise ValueError(f"{path}: Gemma 4 with rope_freqs other than 1 (turning) then "
                             "1e30 (standing still), one per pair, is not supported")  # fmt: skip
        rope_scaling = RopeScaling("proportional", partial_rotary_factor=partial)
    ple = int(get("embedding_length_per_layer_input", 0) or 0)
    sliding_window = get("attention.sliding_window")
    common |= dict(
        num_key_value_heads=int(num_kv),
        head_dim=int(head_dim),
        intermediate_size=int(width),
        rope_scaling=rope_scaling,
        moe=_gguf_gemma4_moe(path, get, num_layers, tensor_names),
    )
    return ModelConfig(
        architecture="gemma4",
        # NOTE: llama.cpp falls back to the global base where freq_base_swa is absent.
        rope_local_theta=float(get("rope.freq_base_swa", common["rope_theta"])),
        sliding_window=int(sliding_window) if sliding_window else None,
        layer_types=layer_types,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=1.0,  # no query scaling: QK-norm bounds the scores
        final_logit_softcapping=get("final_logit_softcapping"),
        global_head_dim=int(global_head_dim),
        # None where the global layers have the window layers' count (as transformers has it).
        num_global_key_value_heads=int(global_kv.pop()) if global_kv - {num_kv} else None,
        attention_k_eq_v=has_v == {False},
        hidden_size_per_layer_input=ple,
        # llama.cpp's per-layer table has a row per token of the vocabulary.
        vocab_size_per_layer_input=common["vocab_size"] if ple else 0,
        kv_source_layers=sources,
        double_wide_mlp=double_wide,
        **common,
    )


def _gguf_gemma4_moe(
    path: Path, get: Any, num_layers: int, tensor_names: set[str]
) -> MoEConfig | None:
    """Gemma 4's experts (26B-A4B) beside every layer's MLP: a router per layer
    (``ffn_gate_inp``) and the experts' gate and up projections fused (``ffn_gate_up_exps``)."""
    num_experts = int(get("expert_count", 0) or 0)
    if not num_experts:
        return None
    routed = [f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(num_layers)]
    fused = all(f"blk.{i}.ffn_gate_up_exps.weight" in tensor_names for i in range(num_layers))
    if not all(routed) or not fused:
        raise ValueError(f"{path}: Gemma 4 with experts on only some layers, or with separate "
                         "ffn_gate_exps / ffn_up_exps, is not supported")  # fmt: skip
    for key in ("expert_used_count", "expert_feed_forward_length"):
        if not isinstance(get(key), int) or get(key) <= 0:
            raise ValueError(f"{path}: GGUF metadata gemma4.{key} must be a positive integer; "
                             f"got {get(key)!r}")  # fmt: skip
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(get("expert_used_count")),
        intermediate_size=int(get("expert_feed_forward_length")),
        renormalize=True,
        sparse_layers=(True,) * num_layers,
    )


def _gemma3_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _hf_weight_format(cfg: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """How the checkpoint stores its matrices (its ``quantization_config``): float, fp8, or
    gpt-oss's MXFP4 experts (read with its MoE); any other scheme is a clear error."""
    quant = cfg.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is None or method == "mxfp4":
        return {}
    if method in ("fp8", "fbgemm_fp8") and quant.get("fmt", "e4m3") == "e4m3":
        block = quant.get("weight_block_size")
        return {"weight_format": "fp8", "fp8_block": tuple(block) if block else None}
    raise ValueError(
        f"{model_dir / 'config.json'}: quantization_config {method!r} is not supported; "
        "tokenmill reads float, fp8 (e4m3) and gpt-oss's mxfp4 checkpoints, and GGUF files"
    )


def _hf_rotary_dim(cfg: dict[str, Any], head_dim: int) -> int | None:
    """The rotated dimensions of a head (``partial_rotary_factor``, top level or among the
    rope parameters), or None for all of them."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * float(factor))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {factor} leaves {dim} of {head_dim} dimensions "
                         "to rotate; it must be an even number above 0")  # fmt: skip
    return None if dim == head_dim else dim


def _hf_rope(cfg: dict[str, Any], head_dim: int) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta) from either transformers key layout."""
    params = cfg.get("rope_parameters")
    local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    if isinstance(params, dict) and FULL_ATTENTION in params:  # per layer type (v5 Gemma 3)
        local = params.get(SLIDING_ATTENTION) or {}
        local_theta = float(local.get("rope_theta", local_theta))
        params = params[FULL_ATTENTION]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling_dict = params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling_dict = cfg.get("rope_scaling") or {}
    rope_type = scaling_dict.get("rope_type") or scaling_dict.get("type") or "default"
    if rope_type == "default":
        return theta, None, local_theta
    if rope_type == "proportional":  # Gemma 4's global layers
        scaling = RopeScaling(
            rope_type="proportional",
            factor=float(scaling_dict.get("factor", 1.0)),
            partial_rotary_factor=float(scaling_dict.get("partial_rotary_factor", 1.0)),
        )
        return theta, scaling, local_theta
    if rope_type == "longrope":
        return theta, _longrope(cfg, scaling_dict), local_theta
    if rope_type == "yarn":
        return theta, _yarn(cfg, scaling_dict), local_theta
    if rope_type not in ("linear", "llama3"):
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: linear, llama3, longrope, yarn"
        )
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(scaling_dict.get("factor", 1.0)),
        low_freq_factor=float(scaling_dict.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_dict.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            scaling_dict.get("original_max_position_embeddings", 8192)
        ),
    )
    return theta, scaling, local_theta


def _longrope(cfg: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """Phi-3's LongRoPE, as transformers reads it: the attention factor from the context's
    growth over the original one unless given."""
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))  # fmt: skip
    factor = params.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(x) for x in params["short_factor"]),
        long_factor=tuple(float(x) for x in params["long_factor"]),
        attention_factor=float(attention_factor),
    )


def _yarn(cfg: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """YaRN as transformers reads it: cos/sin scaled by 0.1 · ln(factor) + 1 unless given."""
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or 4096)  # fmt: skip
    factor = float(params.get("factor") or cfg.get("max_position_embeddings", original) / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
    )
