"""Turns per-step token updates into RequestOutputs: detokenize, stop strings, logprobs, metrics.

A request with ``n > 1`` runs as ``n`` sequences in the scheduler (ids ``<id>`` and
``<id>#1``…); this side joins them back into one RequestOutput with ``n`` completions.

It keeps nothing of the core's (engine_core.py): what it knows of a sequence came in its
RequestUpdates, its timings too (SeqTiming), so the core may run elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from dataclasses import dataclass, field, replace

from tokenmill.core.sched_output import PromptLogprobs, RequestUpdate, SeqTiming
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from tokenmill.request import FinishReason, Request
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqState:
    """Output-side state of one sequence (one of the n completions)."""

    index: int
    seq_id: str
    detokenizer: IncrementalDetokenizer
    # The core's latest timing of it (RequestUpdate.timing); the finish time set here where
    # this side ended it (a stop string, an abort).
    timing: SeqTiming = SeqTiming()
    # Text after stop-string handling; of a delta output, only the part not yet sent.
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # Its text is decoded once, as it finishes: no one reads it before (a final-only output)
    # and no stop string needs it (one Rust call for the whole output, not one a token).
    defer_text: bool = False
    # Its text is read as it comes and no stop string cuts it (most streamed requests): a
    # step's tokens just go through the detokenizer.
    plain_text: bool = False
    # Final-only requests: when the last step gave tokens, and the gaps between such steps
    # (RequestMetrics.inter_token_latencies; no one reads their outputs in between).
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[SeqState]
    # With params.prompt_logprobs: [None, then one entry per prompt position computed so far].
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # While streaming, a text's last ``stop_hold`` characters are held back: they might still
    # turn out to start a stop string.
    stop_hold: int = 0
    num_sent_prompt_logprobs: int = 0  # entries of prompt_logprobs sent (delta outputs)
    embedding: list[float] | None = None  # an embedding request's vector, once its prompt ran
    # params.output_kind, read by every output of every step: two flags, not an enum compare.
    delta: bool = False
    final_only: bool = False

    @property
    def finished(self) -> bool:
        # NOTE: a loop, as all() over a generator cost more (every request, every step).
        for seq in self.seqs:  # noqa: SIM110
            if seq.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._seq_owner: dict[str, tuple[RequestState, SeqState]] = {}
        self._changed: dict[str, RequestState] = {}
        self._failed: dict[str, str] = {}

    def add_request(
        self, request_id: str, prompt: str | None, seqs: list[Request], params: SamplingParams
    ) -> None:
        """``seqs``: the request's sequences, as the core was given them (read here, not kept)."""
        prompt_ids = seqs[0].prompt_token_ids
        hold = max((len(s) for s in params.stop), default=1) - 1
        state = RequestState(
            request_id, prompt, prompt_ids, params, seqs[0].arrival_time, [], stop_hold=hold
        )
        state.delta = params.output_kind == RequestOutputKind.DELTA
        state.final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        for i, req in enumerate(seqs):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            seq = SeqState(i, req.req_id, detok)
            seq.defer_text = state.final_only and not params.stop
            seq.plain_text = not state.final_only and not params.stop
            state.seqs.append(seq)
            self._seq_owner[req.req_id] = (state, seq)
        self.states[request_id] = state

    def seq_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        return [s.seq_id for s in state.seqs] if state else []

    def process(self, updates: list[RequestUpdate]) -> list[str]:
        """Apply one step's updates; returns the sequences a stop string ended (the scheduler
        must finish them). ``collect`` then builds the outputs.

        An update that raises (a bug in detokenizing one request, say) fails its request alone:
        ``pop_failed`` names it.
        """
        changed = self._changed
        stopped_seqs: list[str] = []
        now = time.monotonic()
        for update in updates:
            owner = self._seq_owner.get(update.req_id)
            if owner is None:
                continue
            state, seq = owner
            if self._failed and state.request_id in self._failed:
                continue
            try:
                # n > 1 siblings compute the same prompt: only the first sequence's are kept.
                if update.prompt_logprobs is not None and seq.index == 0:
                    self._append_prompt_logprobs(state, update.prompt_logprobs)
                if update.embedding is not None:
                    state.embedding = update.embedding
                if not update.new_token_ids and update.finish_reason is None:
                    continue  # a prompt chunk's log-probs: nothing to stream until a token
                self._append(seq, update, state.params)
            except Exception as e:
                logger.exception("request %s failed while processing its output", state.request_id)
                self._failed[state.request_id] = f"{type(e).__name__}: {e}"
                changed.pop(state.request_id, None)
                continue
            if update.finish_reason is None and seq.finish_reason is not None:
                stopped_seqs.append(update.req_id)  # stop string: the scheduler must end it
                seq.timing = replace(seq.timing, finished_time=now)
            if not state.final_only:
                changed[state.request_id] = state
                continue
            if update.new_token_ids:  # no output until it finishes: time its steps here
                if seq.last_token_time is not None:
                    seq.inter_token_latencies.append(now - seq.last_token_time)
                seq.last_token_time = now
            if seq.finish_reason is not None and state.finished:  # its last sequence ended
                changed[state.request_id] = state
        return stopped_seqs

    def pop_failed(self) -> dict[str, str]:
        """Requests whose updates raised since the last call: request id -> the error."""
        failed, self._failed = self._failed, {}
        return failed

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a failed request: its final output, finished, with ``error`` set."""
        out = self.abort(request_id)
        if out is not None:
            out.error = error
        return out

    def collect(self, unread: Container[str] = ()) -> list[RequestOutput]:
        """The outputs of the requests that changed since the last call. The delta output of a
        request in ``unread`` (its reader has not yet taken the last one) waits unless it
        finished: none is built meanwhile, and the output a later call builds carries these
        changes too, as the reader would have joined them (RequestOutput.add)."""
        if not unread:
            outputs = [self._make_output(s) for s in self._changed.values()]
            self._changed = {}
            return outputs
        outputs, waiting = [], {}
        for request_id, state in self._changed.items():
            if state.delta and request_id in unread and not state.finished:
                waiting[request_id] = state
            else:
                outputs.append(self._make_output(state))
        self._changed = waiting
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.get(request_id)
        if state is None:
            return None
        self._changed.pop(request_id, None)  # its output, waiting (collect), is this one
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.text += seq.detokenizer.update([])  # any deferred tokens' text
                seq.finish_reason = FinishReason.ABORT
                seq.timing = replace(seq.timing, finished_time=time.monotonic())
        return self._make_output(state)

    def _append(self, seq: SeqState, update: RequestUpdate, params: SamplingParams) -> None:
        if seq.finish_reason is not None:
            return
        if update.timing is not None:
            seq.timing = update.timing
        if update.finish_reason is None and update.logprobs is None:
            # Most steps, where nothing of _append_tokens' applies (no stop strings, no
            # log-probs): a response sent whole keeps its tokens, undecoded, for its end; a
            # streamed one's go through the detokenizer.
            if seq.defer_text:
                seq.detokenizer.defer(update.new_token_ids)
                return
            if seq.plain_text:
                seq.text += seq.detokenizer.update(update.new_token_ids)
                return
        new_ids = update.new_token_ids
        logprobs = update.logprobs
        pairs = list(zip(logprobs.sampled, logprobs.top)) if logprobs is not None else []
        if params.stop and len(new_ids) > 1:
            # Several tokens in one step (kept drafts): one at a time, so that the tokens after
            # a stop string are dropped, as they would never have been sampled one by one.
            for i, token_id in enumerate(new_ids):
                last = i == len(new_ids) - 1
                self._append_tokens(
                    seq, [token_id], pairs[i : i + 1], update if last else None, params
                )
                if seq.finish_reason is not None:
                    return
            return
        self._append_tokens(seq, new_ids, pairs, update, params)

    def _append_tokens(
        self,
        seq: SeqState,
        token_ids: list[int],
        logprobs: list[tuple[TokenLogprob, list[TokenLogprob]]],
        final: RequestUpdate | None,
        params: SamplingParams,
    ) -> None:
        """Append tokens and their logprobs; ``final``: the update, if its finish applies."""
        finish_reason = final.finish_reason if final is not None else None
        if finish_reason is not None:
            # Nothing follows: emit a tail held back for more bytes (an incomplete character).
            new_text = seq.detokenizer.finish(token_ids)
        elif seq.defer_text:
            seq.detokenizer.defer(token_ids)
            new_text = ""
        else:
            new_text = seq.detokenizer.update(token_ids)
        for sampled, top in logprobs:
            seq.logprobs.append(
                PositionLogprobs(self._with_text(sampled), [self._with_text(t) for t in top])
            )
        seq.text += new_text
        if params.stop and new_text:
            self._check_stop_strings(seq, params, len(new_text))
        if seq.finish_reason is None and final is not None and finish_reason is not None:
            seq.finish_reason = finish_reason
            seq.stop_reason = final.stop_reason

    def _append_prompt_logprobs(self, state: RequestState, update: PromptLogprobs) -> None:
        entries = state.prompt_logprobs
        if entries is None:
            return
        # The worker sends each position once, in order, even across preemptions; the position
        # check only keeps a repeat (were there one) from shifting the list.
        for pos, (sampled, top) in enumerate(zip(update.sampled, update.top), update.first_pos):
            if pos == len(entries):
                entries.append(
                    PositionLogprobs(self._with_text(sampled), [self._with_text(t) for t in top])
                )

    @staticmethod
    def _check_stop_strings(seq: SeqState, params: SamplingParams, num_new_chars: int) -> None:
        # A stop string may straddle the old text and the new: search from just before the new.
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(seq.text) - num_new_chars - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = seq.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return
        idx, stop = best
        seq.text = (
            seq.text[: idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
        )
        seq.finish_reason = FinishReason.STOP
        seq.stop_reason = stop

    def _with_text(self, lp: TokenLogprob) -> TokenLogprob:
        token = self.tokenizer.decode([lp.token_id], skip_special_tokens=False)
        return TokenLogprob(lp.token_id, lp.logprob, lp.rank, token)

    def _make_output(self, state: RequestState) -> RequestOutput:
        delta = state.delta
        hold = state.stop_hold
        wants_logprobs = state.params.logprobs is not None
        completions = []
        finished = True
        num_generated = 0
        for seq in state.seqs:
            done = seq.finish_reason is not None
            finished = finished and done
            text = seq.text
            sendable = len(text)
            if hold and not done:  # the held-back tail of a streamed text with stop strings
                sendable = max(seq.num_sent_chars, sendable - hold)
            token_ids = seq.detokenizer.token_ids
            text_delta = text[seq.num_sent_chars : sendable]
            ids_delta = token_ids[seq.num_sent_tokens :]
            logprobs = None
            if wants_logprobs:
                # One entry a token: a delta's are those of its tokens.
                logprobs = seq.logprobs[seq.num_sent_tokens :] if delta else list(seq.logprobs)
            completions.append(
                CompletionOutput(
                    seq.index,
                    text_delta if delta else text[:sendable],
                    ids_delta if delta else list(token_ids),
                    str(seq.finish_reason) if done else None,
                    seq.stop_reason,
                    logprobs,
                    text_delta,
                    ids_delta,
                )
            )
            if delta:  # the sent text is never read again: keep only the rest (no copies)
                seq.text = text[sendable:]
            else:
                seq.num_sent_chars = sendable
            seq.num_sent_tokens = len(token_ids)
            num_generated += len(token_ids)
        if finished:
            self.states.pop(state.request_id, None)
            for seq in state.seqs:
                self._seq_owner.pop(seq.seq_id, None)
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            finished,
            _metrics(state, num_generated),
            None if state.prompt_logprobs is None else self._prompt_logprobs_out(state, delta),
            state.embedding,
        )

    @staticmethod
    def _prompt_logprobs_out(state: RequestState, delta: bool) -> list[PositionLogprobs | None]:
        entries = state.prompt_logprobs
        assert entries is not None
        if not delta:
            return list(entries)
        new = entries[state.num_sent_prompt_logprobs :]
        state.num_sent_prompt_logprobs = len(entries)
        return new


def _metrics(state: RequestState, num_generated: int) -> RequestMetrics:
    """``num_generated``: the tokens of its sequences so far."""
    itls = None
    if state.final_only:
        itls = tuple(t for s in state.seqs for t in s.inter_token_latencies)
    if len(state.seqs) == 1:  # the common case, every step of every request: no lists
        timing = state.seqs[0].timing
        return RequestMetrics(
            state.arrival_time,
            timing.first_scheduled_time,
            timing.first_token_time,
            timing.finished_time,
            len(state.prompt_token_ids),
            num_generated,
            timing.num_cached_tokens,
            timing.num_preemptions,
            itls,
        )
    timings = [s.timing for s in state.seqs]
    first_tokens = [t.first_token_time for t in timings if t.first_token_time is not None]
    scheduled = [t.first_scheduled_time for t in timings if t.first_scheduled_time is not None]
    finished = [t.finished_time for t in timings if t.finished_time is not None]
    return RequestMetrics(
        arrival_time=state.arrival_time,
        first_scheduled_time=min(scheduled) if scheduled else None,
        first_token_time=min(first_tokens) if first_tokens else None,
        finished_time=max(finished) if len(finished) == len(timings) else None,
        num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=num_generated,
        num_cached_tokens=max(t.num_cached_tokens for t in timings),
        num_preemptions=sum(t.num_preemptions for t in timings),
        inter_token_latencies=itls,
    )
