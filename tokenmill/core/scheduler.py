"""Scheduler: FCFS queues and one token budget per step, shared by decodes and prefill chunks.

There are no prefill or decode phases. Each request has ``num_computed_tokens`` (in the KV cache)
and ``num_tokens`` (prompt + outputs); every step gives each running request, then waiting ones,
as many of the missing tokens as the budget allows. A long prompt is thereby chunked, a prefix-
cache hit just starts a request with computed tokens, and a decode is a request missing one token.
When blocks run out, the newest running request is preempted: its blocks are freed and it is
recomputed later from its tokens.

Draft tokens (``Request.draft_token_ids``, set by a proposer) ride along with a decode: the
request is scheduled for its next token plus its drafts, and the drafts the model rejected are
taken back from ``num_computed_tokens`` once the step's output is in (their K/V slots are
simply written again later).

Async scheduling (engine/llm_engine.py): the engine may schedule step N+1 before step N's
tokens are in, so that the host's work overlaps the device's. A request whose step samples
holds a pending token (``Request.num_pending_tokens``) from its scheduling until its output is
in; step N+1 schedules that token like a known one (the worker takes its id from step N's
picks on the device). A request whose pending token is its last (max_tokens, the context) is
not scheduled again; one that stops on its pending token has run one token for nothing, which
is dropped. Only steps whose requests need no host-side view of their tokens to sample the
next one may be run ahead (``SchedulerOutput.can_run_ahead``).
"""

from __future__ import annotations

import time
from collections import deque

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.sched_output import (
    CachedRequestData,
    NewRequestData,
    RequestUpdate,
    RunnerOutput,
    SampledLogprobs,
    SchedulerOutput,
    SeqTiming,
)
from tokenmill.outputs import SpecDecodeStats
from tokenmill.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.kv = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            cache_config.group_windows,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec = SpecDecodeStats()
        self.cache_salts: dict[str, str] = {}
        # Requests whose next step needs this one's tokens on the host (_can_run_ahead false).
        self._no_run_ahead: set[str] = set()
        # Request.stop_ids of the requests with no stop_token_ids, by their end tokens.
        self._eos_sets: dict[tuple[int, ...], frozenset[int]] = {}

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, req: Request, cache_salt: str | None = None) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in the engine")
        params = req.sampling_params
        eos = () if params.ignore_eos else req.eos_token_ids
        if params.stop_token_ids:
            req.stop_ids = frozenset(eos).union(params.stop_token_ids)
        else:  # most requests: the model's end tokens, one set they share (read warm each step)
            key = tuple(eos)
            req.stop_ids = self._eos_sets.setdefault(key, frozenset(key))
        req.max_outputs = min(req.max_tokens, self.config.max_model_len - req.num_prompt_tokens)
        self.requests[req.req_id] = req
        if cache_salt:
            self.cache_salts[req.req_id] = cache_salt
        if not _can_run_ahead(req):
            self._no_run_ahead.add(req.req_id)
        self.waiting.append(req)

    def finish_request(self, req_id: str, reason: FinishReason) -> Request | None:
        """Finish (abort, or stop on a stop string) a request wherever it is; frees its blocks."""
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return None
        self._dequeue(req)
        self._finish(req, reason)
        return req

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def has_finished_to_send(self) -> bool:
        """Finished requests the worker has not heard of (the next step's finished_req_ids)."""
        return bool(self._finished_req_ids)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        running: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        drafts: dict[str, list[int]] = {}
        preempted, budget = self._schedule_running(running, cached_reqs, drafts, budget)
        new: list[tuple[Request, int]] = []
        new_reqs: list[NewRequestData] = []
        if not preempted:  # memory is tight: let running requests finish before new ones join
            self._schedule_waiting(new, new_reqs, budget, running)
        # Batch order: new requests first, then running ones.
        num_scheduled = running
        if new:
            num_scheduled = {req.req_id: n for req, n in new}
            num_scheduled |= running
        out = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
            draft_token_ids=drafts,
            can_run_ahead=not drafts and self._no_run_ahead.isdisjoint(num_scheduled),
        )
        self._finished_req_ids = set()
        self._preempted_req_ids = set()
        # After every waiting request is placed: a sibling waits on its leader's count as it
        # stood before this step (_is_blocked).
        for req, n in new:
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_pending_tokens:
                req.num_pending_tokens += 1  # this step samples its next token
        return out

    def _schedule_running(
        self,
        scheduled: dict[str, int],
        cached_reqs: list[CachedRequestData],
        drafts: dict[str, list[int]],
        budget: int,
    ) -> tuple[bool, int]:
        """Schedule the running requests in order (each its missing tokens, drafts with a
        decode), preempting the newest while blocks run out; (whether any was, budget left).
        Each scheduled one's counts move on at once (one pass over them: this runs every step
        for every request); a victim is always one not yet scheduled (the newest)."""
        preempted = False
        max_model_len = self.config.max_model_len
        salts = self.cache_salts
        allocate_slots = self.kv.allocate_slots
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_outputs = len(req.output_token_ids) + req.num_pending_tokens
            num_tokens = len(req.prompt_token_ids) + num_outputs
            if num_outputs >= req.max_outputs:  # max_tokens, or the context, reached
                i += 1  # its pending token is its last: it finishes when the token is in
                continue
            num_new = min(num_tokens - req.num_computed_tokens, budget)
            if num_new == 1 and req.draft_token_ids:  # a decode: its drafts run with it
                room = min(
                    max_model_len - req.num_tokens,
                    req.max_tokens - req.num_output_tokens - 1,  # the last sample is one more
                    budget - 1,
                )
                del req.draft_token_ids[max(room, 0) :]
                num_new += len(req.draft_token_ids)
            elif req.draft_token_ids:
                req.draft_token_ids.clear()
            salt = salts.get(req.req_id) if salts else None
            new_block_ids = allocate_slots(req, num_new, None, salt)
            while new_block_ids is None:
                victim = self.running.pop()  # the newest request gives way
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_block_ids = allocate_slots(req, num_new, None, salt)
            if new_block_ids is None:
                break
            num_computed = req.num_computed_tokens
            scheduled[req.req_id] = num_new
            cached_reqs.append(CachedRequestData(req.req_id, new_block_ids, num_computed))
            req.num_computed_tokens = num_computed + num_new
            if num_computed + num_new >= num_tokens:
                req.num_pending_tokens += 1  # this step samples its next token
            if req.draft_token_ids:  # each proposal runs once
                drafts[req.req_id], req.draft_token_ids = req.draft_token_ids, []
            budget -= num_new
            i += 1
        return preempted, budget

    def _schedule_waiting(
        self,
        scheduled: list[tuple[Request, int]],
        new_reqs: list[NewRequestData],
        budget: int,
        running: dict[str, int],
    ) -> None:
        """Start waiting requests in order while budget and blocks last (``running``: this
        step's running requests, whose counts already include it)."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._is_blocked(req, running):
                skipped.append(self.waiting.popleft())
                continue
            salt = self.cache_salts.get(req.req_id)
            cached = self.kv.find_cached_prefix(req, salt)
            num_cached = cached.num_blocks * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            block_ids = self.kv.allocate_slots(req, num_new, cached, salt)
            if block_ids is None:
                break
            self.kv.record_prefix_query(req.num_tokens, num_cached)
            self.waiting.popleft()
            now = time.monotonic()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            self.running.append(req)
            scheduled.append((req, num_new))
            new_reqs.append(
                NewRequestData(
                    req_id=req.req_id,
                    token_ids=req.all_token_ids,
                    num_prompt_tokens=req.num_prompt_tokens,
                    sampling_params=req.sampling_params,
                    block_ids=block_ids,
                    num_computed_tokens=num_cached,
                    eos_token_ids=req.eos_token_ids,
                    grammar=req.grammar,
                    thinking=req.thinking,
                )
            )
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _is_blocked(self, req: Request, running: dict[str, int]) -> bool:
        """A preempted request waits for its pending token; n > 1 siblings wait until the
        first sibling's prompt is in the cache (computed by a step before this one, whose
        tokens ``running`` counts)."""
        if req.num_pending_tokens:
            return True
        leader = self.requests.get(req.wait_for_req_id) if req.wait_for_req_id else None
        if leader is None or leader.is_finished or not self.kv.enable_caching:
            return False
        if req.needs_every_position:
            return False  # it takes no prefix hits (see KVCacheManager.find_cached_prefix)
        computed = leader.num_computed_tokens - running.get(leader.req_id, 0)
        return computed < leader.num_prompt_tokens

    def _preempt(self, req: Request) -> None:
        self.kv.free(req, self.cache_salts.get(req.req_id))
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft_token_ids.clear()
        req.num_preemptions += 1
        req.timing_due = True
        self.num_preemptions += 1
        self._preempted_req_ids.add(req.req_id)  # the worker drops its state; resent whole later
        self.waiting.appendleft(req)

    # ---- after the forward pass -------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: RunnerOutput
    ) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        now = time.monotonic()
        sampled, logprobs = runner_out.sampled_token_ids, runner_out.logprobs
        # Most steps carry none of these: no lookup a request for them then.
        prompt_logprobs_of, embeddings = runner_out.prompt_logprobs, runner_out.embeddings
        drafts_in, new_drafts = sched_out.draft_token_ids, runner_out.draft_token_ids
        for req_id in sched_out.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.status == RequestStatus.FINISHED:
                continue
            embedding = embeddings.get(req_id) if embeddings else None
            if embedding is not None:  # an embedding request: its prompt ran, it is done
                req.num_pending_tokens -= 1
                req.first_token_time = now
                self._dequeue(req)
                self._finish(req, FinishReason.STOP)
                updates.append(
                    RequestUpdate(
                        req_id, [], FinishReason.STOP, embedding=embedding, timing=_timing(req)
                    )
                )
                continue
            token_ids = sampled.get(req_id)
            prompt_logprobs = prompt_logprobs_of.get(req_id) if prompt_logprobs_of else None
            if not (token_ids or prompt_logprobs):
                continue
            update = RequestUpdate(req_id, token_ids or [], None, None, logprobs.get(req_id),
                                   prompt_logprobs)  # fmt: skip
            if token_ids:
                req.num_pending_tokens -= 1
                if req.timing_due:  # its first token, or its first since a preemption
                    if req.first_token_time is None:
                        req.first_token_time = now
                    update.timing = _timing(req)
                    req.timing_due = False
                # Rejected drafts: K drafts give 1 + (accepted) tokens; the rest is not computed.
                num_drafts = len(drafts_in.get(req_id, ())) if drafts_in else 0
                if num_drafts:
                    req.num_computed_tokens -= num_drafts + 1 - len(token_ids)
                    self.spec.record(num_drafts, len(token_ids) - 1)
                num_outputs = len(req.output_token_ids) + len(token_ids)
                # The quick test: most steps nothing can end the request.
                if num_outputs < req.max_outputs and req.stop_ids.isdisjoint(token_ids):
                    req.output_token_ids += token_ids
                else:
                    self._append_until_stop(req, update, token_ids)
            if req.status != RequestStatus.FINISHED:
                drafts = new_drafts.get(req_id) if new_drafts else None
                if drafts is not None or req.draft_token_ids:
                    req.draft_token_ids = drafts or []
            else:
                update.timing = _timing(req)
            if update.logprobs is not None:
                _cut_logprobs(update)
            updates.append(update)
        return updates

    def _append_until_stop(self, req: Request, update: RequestUpdate, token_ids: list[int]) -> None:
        """Append a step's tokens one by one, up to the first that ends the request (the ones
        after it are dropped); the update then says why it ended."""
        for i, token_id in enumerate(token_ids):
            req.output_token_ids.append(token_id)
            reason = self._check_stop(req, token_id)
            if reason is not None:
                update.new_token_ids = token_ids[: i + 1]
                update.finish_reason = reason
                update.stop_reason = req.stop_reason
                self._dequeue(req)  # running, or preempted while its token was pending
                self._finish(req, reason)
                return

    def _check_stop(self, req: Request, token_id: int) -> FinishReason | None:
        params = req.sampling_params
        num_outputs = len(req.output_token_ids)
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return FinishReason.STOP
            if params.stop_token_ids and token_id in params.stop_token_ids:
                req.stop_reason = token_id
                return FinishReason.STOP
        if num_outputs >= req.max_tokens:
            return FinishReason.LENGTH
        if len(req.prompt_token_ids) + num_outputs >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _dequeue(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.kv.free(req, self.cache_salts.get(req.req_id))
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finished_time = time.monotonic()
        self.cache_salts.pop(req.req_id, None)
        self._no_run_ahead.discard(req.req_id)
        self._finished_req_ids.add(req.req_id)
        del self.requests[req.req_id]


def _can_run_ahead(req: Request) -> bool:
    """Whether the request's next step may be scheduled before this one's tokens are in: the
    worker samples it without seeing the pending token's id (penalties count token ids; a
    grammar and a thinking budget advance on them), and its log-probs come with the token
    alone."""
    params = req.sampling_params
    return (
        req.grammar is None
        and req.thinking is None
        and not params.has_penalties
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.pooling is None
    )


def _timing(req: Request) -> SeqTiming:
    return SeqTiming(
        req.first_scheduled_time,
        req.first_token_time,
        req.finished_time,
        req.num_cached_tokens,
        req.num_preemptions,
    )


def _cut_logprobs(update: RequestUpdate) -> None:
    """A stop among a step's tokens drops the tokens after it: their log-probs go too."""
    lps, num = update.logprobs, len(update.new_token_ids)
    if lps is not None and len(lps.sampled) > num:
        update.logprobs = SampledLogprobs(lps.sampled[:num], lps.top[:num])
