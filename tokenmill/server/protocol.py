"""OpenAI request and response types, and the checks that turn a request into SamplingParams.

Requests are parsed strictly: JSON types must match (no "2" for 2), NaN and Infinity are
refused, and an unknown top-level field is a 400 that names it. OpenAI fields that tokenmill
cannot honour (functions, audio, ...) are refused unless null, never
ignored. Ranges are checked here with messages that name the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputs
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import bad_request, from_value_error
from tokenmill.tokenizer.chat import ALLOWED_ROLES

MAX_LOGPROBS = 20
MAX_USER_LEN = 256  # the request's "user", metered per value (server/usage.py)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # OpenAI fields tokenmill does not implement: refused unless absent, null, or the value
    # listed here (which means "off").
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def check_unsupported(self) -> None:
        for name, allowed in self.UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise bad_request(
                    f"'{name}' is not supported by tokenmill; remove it from the request",
                    param=name,
                    code="unsupported",
                )


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # Extensions, with vLLM's names.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # false: no speculative decoding for this request (when the server speculates).
    speculative: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Prefix-cache isolation: requests share cached blocks only with the same salt (vLLM's name).
    cache_salt: str | None = None
    # Structured outputs besides response_format (vLLM's names): a JSON schema, a regex, one of
    # a list of strings, a Lark or GBNF grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs(self) -> StructuredOutputs | None:
        """The format asked for: response_format (json_object, json_schema) or one guided_*
        field; 400 for an unknown type or more than one format."""
        asked = {
            name: value
            for name, value in (
                ("guided_json", self.guided_json),
                ("guided_regex", self.guided_regex),
                ("guided_choice", self.guided_choice),
                ("guided_grammar", self.guided_grammar),
            )
            if value is not None
        }
        fmt = self.response_format
        if fmt is not None and fmt.get("type") != "text":
            asked["response_format"] = _response_format(fmt)
        if len(asked) > 1:
            raise bad_request(
                f"give one structured output format; got {', '.join(asked)}",
                param=sorted(asked)[-1],
            )
        if not asked:
            return None
        ((name, value),) = asked.items()
        try:
            if name == "response_format":
                return value
            key = {"guided_json": "json", "guided_regex": "regex"}.get(name, name[7:])
            return StructuredOutputs(**{key: value})
        except ValueError as e:
            raise bad_request(f"{name}: {e}", param=name) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        self.check_unsupported()
        if self.user is not None and len(self.user) > MAX_USER_LEN:
            raise bad_request(
                f"user must be at most {MAX_USER_LEN} characters; got {len(self.user)}",
                param="user",
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "'stream_options' is only allowed with stream: true", param="stream_options"
            )

    def sampling_params(
        self,
        limits: ServerConfig,
        max_model_len: int,
        *,
        max_tokens: int | None,
        max_tokens_name: str,
        logprobs: int | None,
        logprobs_name: str,
    ) -> SamplingParams:
        """Checked SamplingParams; raises APIError (400) naming the request field at fault."""
        cap = min(limits.max_tokens or max_model_len, max_model_len)
        _check_range("n", self.n, 1, limits.max_n)
        if max_tokens is not None:
            _check_range(max_tokens_name, max_tokens, 1, cap)
        _check_range("temperature", self.temperature, 0.0, 2.0)
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise bad_request(f"top_p must be in (0, 1]; got {self.top_p}", param="top_p")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range(logprobs_name, logprobs, 0, MAX_LOGPROBS)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > limits.max_stop:
            raise bad_request(
                f"stop has {len(stop)} strings; at most {limits.max_stop} are allowed",
                param="stop",
            )
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                speculative=self.speculative,
                structured_outputs=self.structured_outputs(),
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=_logit_bias(self.logit_bias),
                # A stream reads each step's new part (the run adds them up, Run.record); a
                # response sent whole reads only the final output: none is built before.
                output_kind=(
                    RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
                ),
            )
        except ValueError as e:
            raise from_value_error(
                e, renames={"max_tokens": max_tokens_name, "logprobs": logprobs_name}
            ) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputs:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                param="response_format",
            )
        return StructuredOutputs(json=schema)
    raise bad_request(
        f"response_format type must be text, json_object or json_schema; got {kind!r}",
        param="response_format",
    )


def _check_range(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}]; got {value}", param=name)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise bad_request(
                f"logit_bias keys must be token ids (integers >= 0 as strings); got {key!r}",
                param="logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise bad_request(
                f"logit_bias values must be in [-100, 100]; got {value} for token {key}",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


# ---- /v1/completions ----------------------------------------------------------------------


class CompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {"suffix": ()}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # With logprobs, the prompt's tokens come first in the choice's logprobs (scoring, as
    # evaluation harnesses ask); with max_tokens 0 nothing is generated.
    echo: bool = False
    # vLLM's: each choice's prompt_logprobs, per prompt position (the first null) the prompt
    # token's log-prob and the top-k alternatives, by token id.
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored, nothing generated."""
        return self.echo and self.max_tokens == 0

    def check(self, limits: ServerConfig) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of must equal n ({self.n}) when given; got {self.best_of}",
                param="best_of",
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad_request(
                f"prompt_logprobs must be in [0, 20]; got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        if (
            self.echo and self.logprobs is not None and self.prompt_logprobs is not None
            and self.prompt_logprobs != self.logprobs
        ):  # fmt: skip
            raise bad_request(
                "with echo, logprobs scores the prompt too: give prompt_logprobs the same value "
                f"({self.logprobs}) or leave it out",
                param="prompt_logprobs",
            )
        prompts = self.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(prompts) > limits.max_prompts:
            raise bad_request(
                f"prompt holds {len(prompts)} prompts; at most {limits.max_prompts} are allowed",
                param="prompt",
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, limits: ServerConfig, max_model_len: int) -> SamplingParams:
        params = self.sampling_params(
            limits,
            max_model_len,
            # scoring only: one token is generated and dropped (the engine always samples)
            max_tokens=1 if self.scores_only else self.max_tokens,
            max_tokens_name="max_tokens",
            logprobs=self.logprobs,
            logprobs_name="logprobs",
        )
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        elif self.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.prompt_logprobs)
        return params


# ---- /v1/chat/completions -----------------------------------------------------------------


class ChatMessage(_Request):
    # The roles the chat templates take (tokenizer/chat.py) in the schema (/openapi.json, so
    # clients and fuzzers send them); another role is a 400 from the template step.
    role: str = Field(json_schema_extra={"enum": [*ALLOWED_ROLES, "developer"]})
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier thinking, sent back

    def as_dict(self) -> dict[str, Any]:
        # OpenAI's "developer" role is the system role of newer models.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


REASONING_EFFORTS = ("low", "medium", "high")
# The chat_template_kwargs a request may send: plain values, never a template or an object.
# enable_thinking (Qwen3), thinking (DeepSeek V3.1, Granite), reasoning_effort (gpt-oss).
CHAT_TEMPLATE_KWARGS: dict[str, tuple[type, tuple[Any, ...] | None]] = {
    "enable_thinking": (bool, None),
    "thinking": (bool, None),
    "reasoning_effort": (str, REASONING_EFFORTS),
}


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """400 naming the key of chat_template_kwargs that is not an allowed plain value."""
    for key, value in kwargs.items():
        param = f"chat_template_kwargs.{key}"
        if key not in CHAT_TEMPLATE_KWARGS:
            raise bad_request(
                f"'{param}' is refused: chat_template_kwargs may hold only "
                f"{', '.join(CHAT_TEMPLATE_KWARGS)}, as plain values",
                param=param,
                code="unsupported",
            )
        kind, choices = CHAT_TEMPLATE_KWARGS[key]
        if not isinstance(value, kind) or (choices is not None and value not in choices):
            what = kind.__name__ if choices is None else "one of " + ", ".join(choices)
            raise bad_request(f"'{param}' must be {what}; got {value!r}", param=param)


class ChatCompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "functions": (),
        "function_call": ("none",),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "reasoning_effort": (),
        "web_search_options": (),
        "store": (False,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Named so that a request sending them is refused with a reason, not as an unknown field:
    # only the model's own template is rendered (in the sandbox, tokenizer.py).
    chat_template: str | None = None
    # Plain values the model's template reads (CHAT_TEMPLATE_KWARGS): thinking on or off.
    chat_template_kwargs: dict[str, Any] | None = None
    # A reasoning model's thinking ends after this many tokens (SamplingParams).
    max_thinking_tokens: int | None = None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: bool | None = None

    def check(self) -> None:
        self.check_common()
        if self.chat_template is not None:
            raise bad_request(
                "'chat_template' in a request is refused: the server renders the model's own "
                "chat template",
                param="chat_template",
                code="unsupported",
            )
        check_template_kwargs(self.chat_template_kwargs or {})
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise bad_request(
                "give max_completion_tokens or max_tokens, not both with different values",
                param="max_completion_tokens",
            )

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def to_sampling_params(self, limits: ServerConfig, max_model_len: int) -> SamplingParams:
        if self.max_completion_tokens is not None:
            max_tokens, name = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, name = self.max_tokens, "max_tokens"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(
            limits,
            max_model_len,
            max_tokens=max_tokens,
            max_tokens_name=name,
            logprobs=logprobs,
            logprobs_name="top_logprobs",
        )
        if self.max_thinking_tokens is None:
            return params
        _check_range("max_thinking_tokens", self.max_thinking_tokens, 0, max_model_len)
        return dataclasses.replace(params, max_thinking_tokens=self.max_thinking_tokens)

    @property
    def max_tokens_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---- /tokenize, /detokenize ---------------------------------------------------------------


class AbortRequest(_Request):
    request_id: str  # the ``id`` of the request's responses ("cmpl-...", "chatcmpl-...")


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info (vLLM's): what a client needs to tokenize as the server does, for
    evaluation harnesses that use the server's tokenizer (/tokenize, /detokenize)."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    model_max_length: int
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    chat_template: str | None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # a reasoning model's thinking, its closing tag included


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class Timings(BaseModel):
    """tokenmill's own timings (OpenAI clients ignore the field)."""

    queue_time_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    decode_tokens_per_s: float | None = None
    cached_prompt_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A reasoning model's thinking (reasoning.py), apart from its answer in content (vLLM's
    # and DeepSeek's field).
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    timings: Timings


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for an echoed prompt's first token, which has no context
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's (prompt_logprobs in the request): by token id, per prompt position, the first null.
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    timings: Timings


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class HealthResponse(BaseModel):
    status: str  # ok; loading, stopping, failed, engine_failed (503)
    error: str | None = None  # why the model failed to load


class VersionResponse(BaseModel):
    version: str


class ResetPrefixCacheResponse(BaseModel):
    reset: bool


class AbortResponse(BaseModel):
    aborted: list[str]  # the engine requests stopped (one per prompt of the request)


class ErrorResponse(BaseModel):
    """The body of every error on the OpenAI-style routes."""

    error: ErrorInfo


# ---- tokenmill's own routes: /v1/usage ----------------------------------------------------


class UsageCounts(BaseModel):
    """Metered requests, tokens and their cost at the server's prices when they ran."""

    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost_usd: float


class UsageBucket(UsageCounts):
    """One group of a usage report; the field named by ``group_by`` is set."""

    day: str | None = None
    key_id: str | None = None
    model: str | None = None
    user: str | None = None


class UsageReport(BaseModel):
    """GET /v1/usage: the filters applied, the groups, and their total."""

    object: Literal["usage"] = "usage"
    key_id: str | None
    user: str | None
    since: float | None
    until: float | None
    group_by: Literal["day", "key", "model", "user"] | None
    data: list[UsageBucket]
    total: UsageCounts


# ---- tokenmill's own routes: /v1/stats (the dashboard's data) ------------------------------


class Percentiles(BaseModel):
    """Seconds, over the stats window (null without samples); ``count``: samples in it."""

    count: int
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


class LiveStats(BaseModel):
    """GET /v1/stats: the server now, and rates and percentiles over the last ``window_s``."""

    time: float  # unix seconds
    model: str
    status: str  # loading, ready, stopping, failed
    window_s: float
    uptime_s: float
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, in [0, 1]
    prefix_cache_hit_rate: float | None  # cached / queried prompt tokens in the window
    ttft_s: Percentiles
    itl_s: Percentiles  # inter-token latency
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    window_prompt_tokens: int
    window_cached_prompt_tokens: int
    window_generation_tokens: int
    num_preemptions: int  # since the engine started
    window_preemptions: int
    spec_acceptance_rate: float | None  # accepted / draft tokens; null when not speculating
    price_per_hour: float | None
    # The machine's price per hour over the window's token rate (tokenmill.cost).
    usd_per_million_output_tokens: float | None
    usd_per_million_total_tokens: float | None
    # What the window's tokens cost at the per-million prices, per million of them.
    usd_per_million_tokens_billed: float | None
