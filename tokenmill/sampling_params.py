"""SamplingParams: how one request picks its tokens and when it stops, validated on creation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from tokenmill.pooling import Pooling


class RequestOutputKind(StrEnum):
    """What a request's RequestOutputs carry, step after step (vLLM's RequestOutputKind).

    - ``cumulative``: each output holds the whole text and token ids so far, and the new part
      in ``text_delta`` / ``token_ids_delta``;
    - ``delta``: each output holds only what is new since the last one (text, token ids and
      log-probs), which saves copying a long output every step;
    - ``final_only``: one output, when the request finishes, with everything: the offline
      ``LLM`` API's choice, as no one reads the steps in between.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A format the output must follow (vLLM's StructuredOutputsParams); set exactly one."""

    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or a GBNF one

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings, with the same meaning as vLLM's and OpenAI's fields.

    Every field is checked in ``__post_init__``; a bad value raises ValueError that names the
    field and its allowed range, before the request reaches the engine.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Log-probs of the prompt's own tokens (vLLM semantics): None = off, 0 = each prompt token's
    # own log-prob, k > 0 = also the top-k alternatives. Such a request skips prefix-cache hits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before penalties (OpenAI semantics).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # False: never propose draft tokens for this request (when the engine speculates).
    speculative: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (structured/).
    structured_outputs: StructuredOutputs | None = None
    # A reasoning model's thinking ends after this many tokens: the engine makes it write its
    # end-of-thinking tag, then it answers (reasoning.py). None: no budget; 0: no thinking.
    max_thinking_tokens: int | None = None
    # An embedding request (pooling.py): its prompt runs, its hidden states pooled into the
    # output's ``embedding``; no token is sampled.
    pooling: Pooling | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # NOTE: containers are checked before they are copied: list(5) would be a TypeError,
        # which the server would answer 500 instead of 400.
        for name, kinds in (("stop", (list, tuple)), ("stop_token_ids", (list, tuple))):
            value = getattr(self, name)
            _check(value is None or isinstance(value, kinds), name, value, "a list")
        _check(
            self.logit_bias is None or isinstance(self.logit_bias, dict),
            "logit_bias",
            self.logit_bias,
            "a map from token ids to biases",
        )
        kinds = [k.value for k in RequestOutputKind]
        _check(self.output_kind in kinds, "output_kind", self.output_kind, f"one of {kinds}")
        self.output_kind = RequestOutputKind(self.output_kind)
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(_is_real(value), name, value, "a finite number")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "true or false")
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            self.structured_outputs,
            "a StructuredOutputs",
        )
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        if self.pooling is not None:
            _check(isinstance(self.pooling, Pooling), "pooling", self.pooling, "a Pooling")
            for name in ("prompt_logprobs", "logprobs", "structured_outputs"):
                _check(getattr(self, name) is None, name, getattr(self, name),
                       "None for an embedding request (pooling)")  # fmt: skip
            _check(self.n == 1, "n", self.n, "1 for an embedding request (pooling)")
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "an integer >= 1",
            )
        if self.max_thinking_tokens is not None:
            _check(
                _is_int(self.max_thinking_tokens) and self.max_thinking_tokens >= 0,
                "max_thinking_tokens",
                self.max_thinking_tokens,
                "an integer >= 0",
            )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "an integer >= 0",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"at most max_tokens ({self.max_tokens})",
            )
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "(0, 1]")
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            self.top_k,
            "-1 (disabled) or an integer >= 1",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "[0, 1]")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "> 0 (1 disables it)",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "[-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "[-2, 2]",
        )
        if self.seed is not None:
            # torch generators take 64-bit seeds; a bigger one would fail inside the step loop.
            _check(
                _is_int(self.seed) and -(2**63) <= self.seed < 2**63,
                "seed",
                self.seed,
                "an integer in [-2**63, 2**63)",
            )
        if self.logprobs is not None:
            _check(
                _is_int(self.logprobs) and 0 <= self.logprobs <= 20,
                "logprobs",
                self.logprobs,
                "an integer in [0, 20]",
            )
        if self.prompt_logprobs is not None:
            _check(
                _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                self.prompt_logprobs,
                "an integer in [0, 20]",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "a list of non-empty strings",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "a list of token ids >= 0",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.logit_bias),
            "logit_bias",
            self.logit_bias,
            "a map from token ids >= 0 to biases",
        )
        _check(
            all(_is_real(b) and -100.0 <= b <= 100.0 for b in self.logit_bias.values()),
            "logit_bias",
            self.logit_bias,
            "a map from token ids to biases in [-100, 100]",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "speculative")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python


def _is_real(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
