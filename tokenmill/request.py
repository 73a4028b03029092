"""Request: one sequence's ids, token lists and counters as the scheduler sees them (no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.reasoning import ThinkingBudget
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS / stop token / stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller or the client went away

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class Request:
    """A sequence in the engine.

    Token states: ``num_computed_tokens`` of ``all_token_ids`` are in the KV cache; the rest
    (the prompt at first, then the last sampled token) are scheduled in later steps.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    # Its compiled structured-output format (structured.CompiledGrammar), for the worker.
    grammar: object | None = None
    # Its thinking budget (reasoning.ThinkingBudget; SamplingParams.max_thinking_tokens).
    thinking: ThinkingBudget | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Sibling requests of an n > 1 group wait for this request's prompt to be computed, so
    # they find its full blocks in the prefix cache instead of computing them again.
    wait_for_req_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Proposed next tokens (speculative decoding), verified in the request's next decode step.
    draft_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    # Tokens sampled by scheduled steps whose output the scheduler has not seen yet: each step
    # whose rows reach the end of the known tokens adds one when it is scheduled, and its output
    # takes it back. With async scheduling the next step is scheduled before the output is in
    # (then 2 for a while), and runs that pending token, whose id only the device knows.
    num_pending_tokens: int = 0
    # What may end it, read at each of its tokens (Scheduler._check_stop's quick test): the
    # ids that may stop it and the outputs it may reach (max_tokens, the context). The
    # scheduler sets them as the request enters.
    stop_ids: frozenset[int] = frozenset()
    max_outputs: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Its next update with a token carries its timing (its first, or its first after a
    # preemption): RequestUpdate.timing.
    timing_due: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]``, without copying the rest."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must run, so it takes no prefix-cache hits: for the
        log-prob of each, or an embedding pooled over them all (pooling.Pooling)."""
        params = self.sampling_params
        pooling = params.pooling
        return params.prompt_logprobs is not None or (
            pooling is not None and pooling.needs_every_position
        )

    @property
    def max_tokens(self) -> int:
        # The engine fills max_tokens in (from the context length) before the request enters.
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens
