"""A roofline capacity planner: what a model on some hardware serves, and what binds it.

A step of the engine reads its weights (and, for each request, its cached K/V) from memory and
computes its linear layers and attention; each part takes the longer of its read time (bytes /
bandwidth) and its compute time (flops / rate); the elementwise ops add their activations' reads
and writes over the bandwidth, and the host a fixed cost per step and a cost per request. From
that:

- prefill of a prompt (chunks of ``max_num_batched_tokens``) -> time to first token;
- a decode step of B requests at context c -> each user's tokens/s (1 / step time);
- KV bytes per token (layers x KV heads x head dim x 2 x dtype; a window layer holds its window)
  -> requests that fit in memory;
- N requests at once, each prompt P and output O -> prefill all, then O - 1 decode steps ->
  throughput, and cost per million tokens at the hardware's price per hour;
- a request rate R -> the concurrency where R x response time = concurrency (Little's law).

The part that takes longest in a step names the binding resource: weight or KV reads
(bandwidth), linear layers or attention (compute), or host work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.bench.hardware import Hardware
from tokenmill.config import ModelConfig, config_from_gguf, config_from_hf
from tokenmill.cost import cost_per_million_tokens
from tokenmill.kv_layout import plan_kv_layout
from tokenmill.modelfile import (
    FLOAT32_BYTES,
    RESIDENT_BYTES_PER_WEIGHT,
    read_gguf,
    safetensors_tensors,
)
from tokenmill.resolve import resolve_model

__all__ = [
    "ModelFacts",
    "Plan",
    "PlanPoint",
    "RateAnswer",
    "StepTime",
    "Workload",
    "model_facts",
    "plan",
]

_EXPERT = re.compile(r"(ffn_(gate|up|down)_exps|\.experts\.\d+\.)")
_HEAD_NAMES = ("output.weight", "lm_head.weight")
_EMBED_NAMES = ("token_embd.weight", "model.embed_tokens.weight", "embed_tokens.weight")
# Bytes a weight takes for --quantization int8 (per-channel int8 codes) and int4 (4-bit codes,
# float32 scale and offset per group of 32), the packed layouts of quant/.
_QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 8 / 32}
_KV_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
_BLOCK_SIZE, _MAX_STEP_TOKENS = 16, 2048  # EngineArgs' block_size, max_num_batched_tokens


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a step of this model reads and computes (bytes and parameters as held in memory)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (None: full)
    dense_params: int  # matmul weights every token runs (attention, dense MLPs, routers)
    dense_bytes: int
    head_params: int  # the output head, run for rows that need logits
    head_bytes: int
    # Matmul kind "TYPE@K" (a GGUF type name, "F32" / "BF16" float, "int8" / "int4"; K inputs)
    # -> parameters of it among the dense weights, and the head's and the experts' kinds: the
    # kernels' rates differ by layout and by row length.
    dense_params_by_kind: dict[str, int]
    head_kind: str
    expert_kind: str
    embedding_bytes: int  # the table (one row read a token); 0 when it is the tied head
    num_experts: int  # per sparse layer (0: dense model)
    top_k: int
    expert_params: int  # one expert, summed over the sparse layers
    expert_bytes: int
    kv_bytes_per_token: float  # K and V of one token in one layer
    max_model_len: int
    # Float32 activations the elementwise ops (norms, residual adds, RoPE, the gated activation)
    # read and write for one token over all layers: about 12 passes over the hidden state and
    # 3 over the MLP's width (gate and up read, their product written) a layer.
    activation_bytes_per_token: int = 0

    @property
    def weight_bytes(self) -> int:
        return (
            self.dense_bytes
            + self.head_bytes
            + self.embedding_bytes
            + self.num_experts * self.expert_bytes
        )

    def kv_bytes_per_sequence(self, num_tokens: int) -> float:
        """Bytes a request of ``num_tokens`` holds at most in the engine's blocks (of 16 tokens,
        steps of 2,048, its defaults): a full-attention layer's every token, a window layer's
        window and step (kv_layout.py)."""
        layout = plan_kv_layout(self.layer_windows, self.max_model_len)
        num_blocks = layout.blocks_held(num_tokens, _BLOCK_SIZE, _MAX_STEP_TOKENS)
        return num_blocks * layout.group_size * _BLOCK_SIZE * self.kv_bytes_per_token

    def kv_tokens_read(self, context_len: int) -> int:
        """Token-layers of K/V a query at ``context_len`` attends to (windows cut it)."""
        return sum(context_len if w is None else min(w, context_len) for w in self.layer_windows)

    def experts_touched(self, num_tokens: int) -> float:
        """Expected distinct experts a layer runs for ``num_tokens`` tokens, each choosing
        ``top_k`` of ``num_experts`` (uniform routing)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)


def model_facts(
    model: str,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    gpu: bool = False,
) -> ModelFacts:
    """The facts of a model (alias, .gguf or HF dir) as the engine would hold it: a GGUF's
    weights packed as stored unless ``quantization`` says otherwise, float weights float32 on a
    CPU and bfloat16 on a GPU; the KV cache in ``kv_cache_dtype`` (auto: the weights' dtype)."""
    source = resolve_model(model)
    float_bytes = 2.0 if gpu else FLOAT32_BYTES
    if source.format == "gguf":
        header = read_gguf(source.path)
        config = config_from_gguf(source.path, header.metadata, {t.name for t in header.tensors})
        tensors = [  # (name, elements, inputs K of a matrix or 0, type)
            (t.name, t.num_elements, t.shape[-1] if len(t.shape) > 1 else 0, t.type_name)
            for t in header.tensors
        ]
    else:
        config = config_from_hf(source.path)
        tensors = [
            (name, n, shape[-1] if len(shape) > 1 else 0, "")
            for name, n, shape, _ in safetensors_tensors(source.path)
        ]
    float_type = "BF16" if gpu else "F32"
    kept = RESIDENT_BYTES_PER_WEIGHT if quantization in (None, "gguf") else {}
    held = []  # (name, elements, matmul kind as held, bytes a weight)
    for name, numel, k, stored in tensors:
        if not k:
            continue  # norms and biases: no matmul, few bytes
        if quantization in _QUANTIZED_BYTES:
            held.append((name, numel, f"{quantization}@{k}", _QUANTIZED_BYTES[quantization]))
        elif stored in kept:
            held.append((name, numel, f"{stored}@{k}", kept[stored]))
        else:  # float, or a type the engine dequantizes at load
            held.append((name, numel, f"{float_type}@{k}", float_bytes))

    dense = head = embed = expert = 0
    dense_b = head_b = embed_b = expert_b = 0.0
    by_kind: dict[str, int] = {}
    head_kind = expert_kind = embed_kind = f"{float_type}@{config.hidden_size}"
    for name, numel, kind, per in held:
        nbytes = numel * per
        if name in _HEAD_NAMES:
            head, head_b, head_kind = head + numel, head_b + nbytes, kind
        elif name in _EMBED_NAMES:
            embed, embed_b, embed_kind = embed + numel, embed_b + nbytes, kind
        elif _EXPERT.search(name):
            expert, expert_b, expert_kind = expert + numel, expert_b + nbytes, kind
        else:
            dense, dense_b = dense + numel, dense_b + nbytes
            by_kind[kind] = by_kind.get(kind, 0) + numel
    if not head:  # tied: the table is the head
        head, head_b, embed_b, head_kind = embed, embed_b, 0.0, embed_kind
    moe = config.moe
    num_experts = moe.num_experts if moe else 0
    kv_dtype = kv_cache_dtype if kv_cache_dtype != "auto" else ("bfloat16" if gpu else "float32")
    # int8 / fp8: a byte an element and a float32 scale per token and KV head.
    elem = _KV_BYTES.get(kv_dtype, 1.0 + 4 / config.head_dim)
    return ModelFacts(
        name=source.path.name,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        layer_windows=config.layer_windows,  # the layers that keep K/V
        dense_params=dense,
        dense_bytes=int(dense_b),
        head_params=head,
        head_bytes=int(head_b),
        dense_params_by_kind=by_kind,
        head_kind=head_kind,
        expert_kind=expert_kind,
        embedding_bytes=int(embed_b),
        num_experts=num_experts,
        top_k=moe.top_k if moe else 0,
        expert_params=expert // num_experts if num_experts else 0,
        expert_bytes=int(expert_b / num_experts) if num_experts else 0,
        kv_bytes_per_token=2 * config.num_key_value_heads * config.head_dim * elem,
        max_model_len=config.max_position_embeddings,
        activation_bytes_per_token=config.num_hidden_layers
        * 4
        * (12 * config.hidden_size + 3 * _mlp_width(config)),
    )


def _mlp_width(config: ModelConfig) -> int:
    """The MLP width one token runs: the dense one, or its experts' and the shared expert's."""
    moe = config.moe
    if moe is None:
        return config.intermediate_size
    return moe.top_k * moe.intermediate_size + moe.shared_intermediate_size


def linear_seconds(m: ModelFacts, hw: Hardware, rows: int, head_rows: int) -> float:
    """Compute time of a step's linear layers for ``rows`` tokens, ``head_rows`` of which need
    logits: each matmul kind at its kernel's rate."""
    seconds = sum(
        2 * rows * params / hw.matmul_rate(rows, kind)
        for kind, params in m.dense_params_by_kind.items()
    )
    if m.expert_params:
        seconds += 2 * rows * m.top_k * m.expert_params / hw.matmul_rate(rows, m.expert_kind)
    if head_rows:
        seconds += 2 * head_rows * m.head_params / hw.matmul_rate(head_rows, m.head_kind)
    return seconds


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's parts in seconds; the step takes max(read, compute) of each part plus host."""

    weight_read: float
    linear_compute: float
    kv_read: float
    attention_compute: float
    activation_read: float  # the elementwise ops, bound by bandwidth
    host: float

    @property
    def total(self) -> float:
        return (
            max(self.weight_read, self.linear_compute)
            + max(self.kv_read, self.attention_compute)
            + self.activation_read
            + self.host
        )

    @property
    def binding(self) -> str:
        """The part that takes longest, named by the resource it uses."""
        parts = {
            "bandwidth (weight reads)": self.weight_read,
            "compute (linear layers)": self.linear_compute,
            "bandwidth (KV cache reads)": self.kv_read,
            "compute (attention)": self.attention_compute,
            "bandwidth (elementwise ops)": self.activation_read,
            "host (scheduling, sampling)": self.host,
        }
        return max(parts, key=parts.__getitem__)

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(
            self.weight_read + other.weight_read,
            self.linear_compute + other.linear_compute,
            self.kv_read + other.kv_read,
            self.attention_compute + other.attention_compute,
            self.activation_read + other.activation_read,
            self.host + other.host,
        )


_ZERO = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def decode_step(m: ModelFacts, hw: Hardware, batch: int, context_len: int) -> StepTime:
    """A step that decodes one token for each of ``batch`` requests at ``context_len``."""
    layer_bytes = m.dense_bytes + m.experts_touched(batch) * m.expert_bytes
    kv_tokens = m.kv_tokens_read(context_len)
    return StepTime(
        weight_read=_read_seconds(hw, layer_bytes, m.head_bytes),
        linear_compute=linear_seconds(m, hw, batch, batch),
        kv_read=batch * kv_tokens * m.kv_bytes_per_token / hw.bandwidth_bytes_per_s,
        attention_compute=4 * batch * m.num_heads * m.head_dim * kv_tokens
        / hw.decode_attention_flops,
        activation_read=batch * m.activation_bytes_per_token / hw.bandwidth_bytes_per_s,
        host=hw.step_overhead_s + batch * hw.request_overhead_s,
    )  # fmt: skip


def prefill_step(
    m: ModelFacts, hw: Hardware, chunks: list[tuple[int, int]], num_logits: int
) -> StepTime:
    """A step that prefills ``chunks`` (start position, tokens) of prompts; ``num_logits``
    prompts finish in it and need the head."""
    num_tokens = sum(n for _, n in chunks)
    layer_bytes = m.dense_bytes + m.experts_touched(num_tokens) * m.expert_bytes
    kv_tokens = sum(
        _causal_kv_tokens(start, n, window) for start, n in chunks for window in m.layer_windows
    )
    return StepTime(
        weight_read=_read_seconds(hw, layer_bytes, m.head_bytes if num_logits else 0),
        linear_compute=linear_seconds(m, hw, num_tokens, num_logits),
        kv_read=0.0,  # a prompt's own K/V come from the step's activations
        attention_compute=4 * m.num_heads * m.head_dim * kv_tokens / hw.prefill_attention_flops,
        activation_read=num_tokens * m.activation_bytes_per_token / hw.bandwidth_bytes_per_s,
        host=hw.step_overhead_s + len(chunks) * hw.request_overhead_s,
    )


def _read_seconds(hw: Hardware, layer_bytes: float, head_bytes: float) -> float:
    """Weights read: the layers' matrices at their (smaller-matrix) rate, the head at the big."""
    layer_rate = hw.layer_bandwidth_bytes_per_s or hw.bandwidth_bytes_per_s
    return layer_bytes / layer_rate + head_bytes / hw.bandwidth_bytes_per_s


def _causal_kv_tokens(start: int, num_tokens: int, window: int | None) -> int:
    """Keys the queries at positions start .. start + num_tokens - 1 see (each sees itself)."""
    if window is None:
        first, last = start + 1, start + num_tokens
        return (first + last) * num_tokens // 2
    return sum(min(pos + 1, window) for pos in range(start, start + num_tokens))


def prefill_steps(
    m: ModelFacts, hw: Hardware, num_prompts: int, prompt_len: int, token_budget: int
) -> list[tuple[StepTime, int]]:
    """``num_prompts`` prompts of ``prompt_len`` arriving together, scheduled as the engine's
    chunked prefill does (prompts in order, each step filled up to ``token_budget`` tokens):
    each step's time and how many prompts finish in it."""
    steps = []
    prompt_idx, done = 0, 0  # the prompt being prefilled, and its tokens already computed
    while prompt_idx < num_prompts:
        chunks, finished, budget = [], 0, token_budget
        while budget and prompt_idx < num_prompts:
            n = min(budget, prompt_len - done)
            chunks.append((done, n))
            budget -= n
            done += n
            if done == prompt_len:
                prompt_idx, done, finished = prompt_idx + 1, 0, finished + 1
        steps.append((prefill_step(m, hw, chunks, finished), finished))
    return steps


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """N requests served together: their prompts prefilled, then their outputs decoded."""

    concurrency: int
    ttft_s: float  # mean over the N requests (they queue behind each other's prefill)
    prefill_s: float  # all N prompts
    decode_s: float  # the output_len - 1 decode steps after it
    decode_step: StepTime  # the mean decode step
    tokens_per_s_per_user: float  # 1 / mean decode step
    output_tokens_per_s: float  # over prefill + decode
    total_tokens_per_s: float
    cost_per_million_output: float | None
    cost_per_million_total: float | None
    fits_in_memory: bool

    @property
    def response_time_s(self) -> float:
        """Mean time from arrival to the last token."""
        return self.ttft_s + self.decode_s


def serve_batch(
    m: ModelFacts,
    hw: Hardware,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    token_budget: int,
    max_concurrency: int,
) -> PlanPoint:
    """``concurrency`` requests arriving together: prefill them all, then decode together."""
    steps = prefill_steps(m, hw, concurrency, prompt_len, token_budget)
    clock, ttft_sum = 0.0, 0.0
    for step, finished in steps:
        clock += step.total
        ttft_sum += finished * clock
    prefill_s = clock
    decode = _ZERO
    for i in range(1, output_len):  # the first token comes with the prefill
        decode = decode + decode_step(m, hw, concurrency, prompt_len + i)
    decode_s = decode.total
    num_steps = max(1, output_len - 1)
    mean_step = StepTime(*(getattr(decode, f) / num_steps for f in StepTime.__slots__))
    elapsed = prefill_s + decode_s
    out_tps = concurrency * output_len / elapsed
    total_tps = concurrency * (prompt_len + output_len) / elapsed
    return PlanPoint(
        concurrency=concurrency,
        ttft_s=ttft_sum / concurrency,
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_step=mean_step,
        tokens_per_s_per_user=(1 / mean_step.total) if output_len > 1 else 0.0,
        output_tokens_per_s=out_tps,
        total_tokens_per_s=total_tps,
        cost_per_million_output=cost_per_million_tokens(hw.price_per_hour, out_tps),
        cost_per_million_total=cost_per_million_tokens(hw.price_per_hour, total_tps),
        fits_in_memory=concurrency <= max_concurrency,
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """What the planner is asked about."""

    prompt_len: int = 512
    output_len: int = 128
    concurrency: tuple[int, ...] = ()  # points to plan (empty: powers of two up to the fit)
    request_rate: float | None = None  # requests/s arriving (Poisson); None: not asked
    token_budget: int = 2048  # max_num_batched_tokens
    max_num_seqs: int = 128
    kv_cache_bytes: int | None = None  # None: 90% of the memory the weights leave

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len", "token_budget", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("--concurrency values must be >= 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")


@dataclass(frozen=True, slots=True)
class RateAnswer:
    """Where a request rate settles: the concurrency C with C = rate x response time."""

    request_rate: float
    concurrency: float
    point: PlanPoint | None  # the plan at ceil(C); None: the rate exceeds what the hardware serves
    max_request_rate: float  # requests/s at the largest concurrency that fits


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelFacts
    hardware: Hardware
    workload: Workload
    kv_cache_bytes: int
    max_concurrency: int  # requests of prompt + output tokens that fit in the KV cache
    points: list[PlanPoint]
    rate: RateAnswer | None


def plan(m: ModelFacts, hw: Hardware, w: Workload) -> Plan:
    """The plan for model ``m`` on ``hw`` under workload ``w``."""
    if m.weight_bytes > hw.memory_bytes:
        raise ValueError(
            f"{m.name} needs {m.weight_bytes / 1e9:.1f} GB for its weights; {hw.name} has "
            f"{hw.memory_bytes / 1e9:.1f} GB"
        )
    seq_len = w.prompt_len + w.output_len
    if seq_len > m.max_model_len:
        raise ValueError(
            f"prompt-len + output-len = {seq_len} exceeds {m.name}'s context of {m.max_model_len}"
        )
    kv_bytes = w.kv_cache_bytes
    if kv_bytes is None:
        kv_bytes = int((hw.memory_bytes - m.weight_bytes) * 0.9)
    fit = min(w.max_num_seqs, int(kv_bytes // m.kv_bytes_per_sequence(seq_len)))
    if fit < 1:
        raise ValueError(
            f"one request of {seq_len} tokens needs {m.kv_bytes_per_sequence(seq_len) / 1e6:.0f} "
            f"MB of KV cache; {kv_bytes / 1e6:.0f} MB are left"
        )

    def at(c: int) -> PlanPoint:
        return serve_batch(m, hw, c, w.prompt_len, w.output_len, w.token_budget, fit)

    sizes = sorted(set(w.concurrency)) or _powers_of_two(fit)
    points = [at(c) for c in sizes]
    rate = None if w.request_rate is None else _settle(w.request_rate, at, fit)
    return Plan(m, hw, w, kv_bytes, fit, points, rate)


def _powers_of_two(limit: int) -> list[int]:
    out, c = [], 1
    while c < limit:
        out.append(c)
        c *= 2
    return [*out, limit]


def _settle(rate: float, at, fit: int) -> RateAnswer:
    """Little's law: the smallest concurrency C whose response time R(C) gives rate x R(C) <= C.
    More arrivals than the fullest batch serves leave no steady state."""
    top = at(fit)
    max_rate = fit / top.response_time_s
    for c in range(1, fit + 1):
        point = at(c)
        if rate * point.response_time_s <= c:
            return RateAnswer(rate, rate * point.response_time_s, point, max_rate)
    return RateAnswer(rate, float("inf"), None, max_rate)
