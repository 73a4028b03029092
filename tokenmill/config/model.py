"""The model's architecture as every layer below reads it: ``ModelConfig``, normalized across
checkpoint formats (config/checkpoint.py reads a checkpoint into it), and its parts."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.resolve import ModelSource

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-embedding frequency scaling: ``linear``, Llama 3's ``llama3``, Phi-3's
    ``longrope`` (per-frequency divisors: ``short_factor`` for positions within
    ``original_max_position_embeddings``, ``long_factor`` beyond, and cos/sin scaled by
    ``attention_factor``), or ``yarn`` (gpt-oss)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # cos and sin are scaled by it (longrope, yarn).
    attention_factor: float = 1.0
    # YaRN (gpt-oss): frequencies blended between interpolated and original over the band of
    # dimensions that turn between beta_slow and beta_fast times in the original context.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


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
    # gpt-oss: router and experts carry biases, and each expert's GLU is clamped to ±limit:
    # gate · σ(1.702 · gate) · (up + 1) with gate ≤ limit and |up| ≤ limit.
    swiglu_limit: float | None = None
    # How the experts' weights are kept: "float", or "mxfp4" as gpt-oss's files hold them.
    expert_format: str = "float"


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Which shard of the model a worker holds: rank ``rank`` of ``size`` tensor-parallel
    ranks (issue 25). ``size`` 1 is the whole model."""

    rank: int = 0
    size: int = 1


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
    # Gemma 2: attention scores are soft-capped (cap · tanh(s / cap)) before the softmax.
    attn_logit_softcapping: float | None = None
    # gpt-oss: a learned logit per head joins each softmax (a "sink" that takes weight and
    # gives no value), and the attention output projection has a bias.
    attention_sinks: bool = False
    o_proj_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sparse MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); None: every MLP is dense.
    moe: MoEConfig | None = None
    # OLMoE and OLMo 2: q and k are RMS-normalized over all their heads at once (Qwen3 and Gemma
    # 3 norm each head), and (OLMoE) q/k/v clipped to ±clip_qkv when set.
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    # The leading dimensions of each head RoPE rotates (Phi-4-mini: 3/4 of them); None: all.
    rotary_dim: int | None = None
    # SmolLM3: per layer, whether it rotates q and k (its NoPE layers do not); empty: all do.
    rope_layers: tuple[bool, ...] = ()
    # How a Hugging Face checkpoint stores its matrices: "float", or "fp8" (e4m3 with float32
    # scales, per tensor or row, or per [bn, bk] block: ``fp8_block``; quant/fp8.py).
    weight_format: str = "float"
    fp8_block: tuple[int, int] | None = None
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

    def layer_uses_rope(self, layer_idx: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_idx]

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
