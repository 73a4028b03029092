"""What leaves the engine: RequestOutput, CompletionOutput, RequestMetrics, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TypeVar

from tokenmill.pooling import Pooling

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one candidate token at one position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    token: str = ""


@dataclass(slots=True)
class PositionLogprobs:
    """The sampled token's logprob plus the top-k alternatives at one output position."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, in seconds (monotonic clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # A final-only output's (SamplingParams.output_kind): the seconds between the steps that
    # gave it tokens, as a client reading each step would have seen them (the server's
    # inter-token latency histogram); None for the other kinds, whose readers time them.
    inter_token_latencies: tuple[float, ...] | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (vLLM's TPOT)."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_generation_tokens <= 1:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request; in streaming, ``text_delta`` is the new part."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of a request after an engine step (or at its end, from ``LLM.generate``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context); entry i is prompt token i's log-prob given tokens < i, plus alternatives.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # An embedding request's vector (SamplingParams.pooling), in its finished output.
    embedding: list[float] | None = None
    # Set when the request failed inside the engine (the others go on): what went wrong. The
    # output is finished; its sequences end with finish_reason "abort".
    error: str | None = None

    def accumulating(self) -> RequestOutput:
        """A copy of a delta output (SamplingParams.output_kind "delta") whose lists are its
        own, for later delta outputs to be ``add``-ed to."""
        return replace(
            self,
            outputs=[_owned(c) for c in self.outputs],
            prompt_logprobs=_copy(self.prompt_logprobs),
        )

    def add(self, later: RequestOutput) -> None:
        """Join ``later``, the request's next delta output, to this one (from
        ``accumulating``): the two read as one delta output, spanning both steps. Added up
        from a request's first output, that is the cumulative output: its lists grow by each
        delta (the text is copied, a memcpy), where a cumulative output copies every list."""
        kept = {c.index: c for c in self.outputs}
        for c in later.outputs:
            into = kept.get(c.index)
            if into is None:  # not in the first output (there, every sequence is)
                self.outputs.append(_owned(c))
                continue
            into.text += c.text
            into.text_delta = into.text  # a delta output's text is its delta
            into.token_ids.extend(c.token_ids)
            if into.logprobs is None:
                into.logprobs = _copy(c.logprobs)
            elif c.logprobs:
                into.logprobs.extend(c.logprobs)
            into.finish_reason, into.stop_reason = c.finish_reason, c.stop_reason
        if self.prompt_logprobs is None:
            self.prompt_logprobs = _copy(later.prompt_logprobs)
        elif later.prompt_logprobs:
            self.prompt_logprobs.extend(later.prompt_logprobs)
        self.finished, self.metrics = later.finished, later.metrics
        self.embedding = later.embedding if later.embedding is not None else self.embedding
        self.error = later.error if later.error is not None else self.error


def _owned(c: CompletionOutput) -> CompletionOutput:
    """A delta completion whose lists are its own (its ids are its delta ids: one list)."""
    ids = list(c.token_ids)
    return replace(c, token_ids=ids, token_ids_delta=ids, logprobs=_copy(c.logprobs))


def _copy(items: list[T] | None) -> list[T] | None:
    return None if items is None else list(items)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine serves, fixed once it is built: for the server, benchmarks and logs."""

    model: str  # as the user named it (alias, path)
    model_path: str  # the GGUF file or Hugging Face directory it resolved to
    architecture: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    device: str
    dtype: str
    quantization: str | None  # None: float weights in ``dtype``
    weight_nbytes: int
    num_parameters: int
    weight_format: str  # "gguf" or "hf" (a Hugging Face directory)
    file_type: str | None  # a GGUF's llama.cpp file type ("Q4_K_M"), else None
    kv_cache_dtype: str  # "auto" stores K/V in ``dtype``
    block_size: int
    num_kv_blocks: int  # usable blocks (the null block excluded)
    kv_cache_nbytes: int
    # The longest request whose K/V fit (at most num_kv_blocks x block_size): fewer blocks than
    # tokens when sliding-window layers keep only their window (kv_layout.py).
    num_kv_tokens: int
    # The reasoning format the server splits outputs by (reasoning.py): "think", or None.
    reasoning: str | None = None
    # How it pools embeddings (pooling.py) when it serves them (--task embed, or an embedding
    # checkpoint); None: it generates.
    pooling: Pooling | None = None


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding so far: verified proposals, their tokens, the ones kept."""

    num_drafts: int = 0  # (request, step) pairs that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts kept at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_len(self) -> float:
        """Tokens a verifying step gave on average: the kept drafts plus the sampled one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load, for metrics and health checks."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # Mixtures of experts with EngineArgs.moe_router_stats: layer -> the tokens each of its
    # experts has run since the engine started (a prefill's tokens and a decode's alike).
    expert_tokens: dict[int, tuple[int, ...]] | None = None
