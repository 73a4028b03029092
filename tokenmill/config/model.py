"""The model's architecture as every layer below reads it: ``ModelConfig``, normalized across
checkpoint formats (config/checkpoint.py reads a checkpoint into it), and its parts."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.resolve import ModelSource

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# A layer whose token mixer is linear attention with a recurrent state (Qwen3-Next and Qwen3.5's
# Gated DeltaNet): it holds no K/V, only a fixed-size state per request.
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-embedding frequency scaling: ``linear``, Llama 3's ``llama3``, Phi-3's
    ``longrope`` (per-frequency divisors: ``short_factor`` for positions within
    ``original_max_position_embeddings``, ``long_factor`` beyond, and cos/sin scaled by
    ``attention_factor``), ``yarn`` (gpt-oss), or ``proportional`` (Gemma 4's global layers)."""

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
    # Gemma 4's "proportional" RoPE: only the first ``partial_rotary_factor`` of a head's
    # frequency pairs turn (the rest stand still, their dimensions passing through), each at the
    # frequency it has in the whole head; all divided by ``factor``.
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Yang et al., 2025) of a hybrid model: q/k/v pass a causal
    depthwise convolution of ``conv_kernel`` taps, then a gated delta rule updates a
    [k_head_dim, v_head_dim] state per value head. A request carries, per such layer, the
    convolution's last ``conv_kernel - 1`` inputs and those states (attention/recurrent.py).
    ``v_heads_tiled``: the value heads are ordered k0 k1 .. k0 k1
    .. by the key head they read (llama.cpp's Qwen3.5 GGUFs, for its broadcasts) rather than in
    groups k0 k0 .. k1 k1 .. (the checkpoints')."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


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
    # Gemma 4: full-attention layers have their own head width and (where set) their own KV
    # heads; with ``attention_k_eq_v`` their values are their key projection's output (no
    # v_proj). Every Gemma 4 layer RMS-normalizes its values without a gain (v_norm).
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    # Gemma 4's per-layer embeddings (PLE): each layer adds a gated input of this width of its
    # own, from a second embedding table (``vocab_size_per_layer_input`` rows, every layer's
    # slice side by side) and a projection of the token's embedding; 0: none.
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    # Gemma 4: per layer, the layer whose K/V it attends with; a KV-sharing layer names an earlier
    # one and keeps no cache of its own. Empty: every layer its own.
    kv_source_layers: tuple[int, ...] = ()
    # Gemma 4: the KV-sharing layers' MLPs are twice intermediate_size wide.
    double_wide_mlp: bool = False
    # How a Hugging Face checkpoint stores its matrices: "float", or "fp8" (e4m3 with float32
    # scales, per tensor or row, or per [bn, bk] block: ``fp8_block``; quant/fp8.py).
    weight_format: str = "float"
    fp8_block: tuple[int, int] | None = None
    # Hybrid models (Qwen3-Next, Qwen3.5): the linear-attention layers' shape (their
    # layer_types say which), and whether full attention's output is gated by a sigmoid of a
    # second half of q_proj's rows (Qwen's "gated attention").
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
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
        if self.architecture == "gemma4":
            raise ValueError(
                f"tensor_parallel_size {size}: Gemma 4 (per-layer KV shapes) is not split across "
                "ranks yet; use tensor_parallel_size 1"
            )
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

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose K/V cache layer ``layer_idx`` attends with: itself, or for Gemma 4's
        KV-sharing layers the last earlier layer of its kind that keeps one."""
        return self.kv_source_layers[layer_idx] if self.kv_source_layers else layer_idx

    def layer_head_dim(self, layer_idx: int) -> int:
        """A layer's head width (Gemma 4's full-attention layers: ``global_head_dim``)."""
        if self.global_head_dim and self.layer_types[layer_idx] == FULL_ATTENTION:
            return self.global_head_dim
        return self.head_dim

    def layer_num_kv_heads(self, layer_idx: int) -> int:
        """A layer's KV heads on this rank (Gemma 4's full-attention layers may have fewer)."""
        if self.num_global_key_value_heads and self.layer_types[layer_idx] == FULL_ATTENTION:
            return max(1, self.num_global_key_value_heads // self.tp.size)
        return self.num_local_kv_heads

    def layer_uses_rope(self, layer_idx: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_idx]

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of a layer in tokens, or None for full attention."""
        if self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V, in order (all but linear-attention ones). The KV cache and
        its layout (kv_layout.py) count these alone: the i-th of them is KV layer i."""
        return tuple(
            i
            for i, t in enumerate(self.layer_types)
            if t != LINEAR_ATTENTION and self.kv_source(i) == i  # Gemma 4's sharing layers: none
        )

    @property
    def kv_layer_shapes(self) -> tuple[tuple[int, int], ...]:
        """Each KV layer's (KV heads on this rank, head_dim), as its cache holds them."""
        return tuple((self.layer_num_kv_heads(i), self.layer_head_dim(i)) for i in self.kv_layers)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layers)

    def kv_layer_index(self, layer_idx: int) -> int:
        """Layer ``layer_idx``'s place among the KV layers (its K/V cache's index)."""
        return self.kv_layers.index(layer_idx)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers, in order: the i-th holds recurrent state i."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every KV layer's attention window (``layer_sliding_window``), in order."""
        return tuple(self.layer_sliding_window(i) for i in self.kv_layers)

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return float(scalar) ** -0.5
