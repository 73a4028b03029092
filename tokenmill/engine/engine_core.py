"""EngineCore: the scheduler and the executor. Sequences in, each step's RequestUpdates out.

It knows token ids only: no tokenizer, no text, no RequestOutputs. LLMEngine (llm_engine.py)
sits in front of it: it validates and tokenizes requests, and turns the updates into outputs
(detokenizing, stop strings), telling the core which sequences a stop string ended. All that
passes between the two is plain data (Request, RequestUpdate), so the core can run where the
output side does not hold it up (vLLM's engine-core process; issue 48).

A step is schedule -> execute -> update_from_output. With async scheduling (on with CUDA) a
step that may run ahead is launched instead, and its updates returned by the next call, after
that call has scheduled and launched the step after it: the host's work for one step overlaps
the device's run of the other.

    call k:    schedule N+1 | launch N+1 | collect N -> update N
    device:    ... step N runs ...    | step N+1 runs ...
"""

from __future__ import annotations

import dataclasses

from tokenmill.config import EngineConfig
from tokenmill.core import RunnerOutput, Scheduler, SchedulerOutput
from tokenmill.core.sched_output import RequestUpdate
from tokenmill.executor import Executor
from tokenmill.outputs import EngineStats
from tokenmill.request import FinishReason, Request


class EngineCore:
    """``executor``: initialized with ``config``'s cache (its blocks are the scheduler's)."""

    def __init__(self, config: EngineConfig, executor: Executor, async_scheduling: bool) -> None:
        self.executor = executor
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)
        self.async_scheduling = async_scheduling
        self._launched: SchedulerOutput | None = None  # the step whose output is not in yet

    def add_requests(self, seqs: list[Request], cache_salt: str | None = None) -> None:
        """Queue a request's sequences, all or none: ValueError if an id is in use."""
        taken = [req.req_id for req in seqs if req.req_id in self.scheduler.requests]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        for req in seqs:
            self.scheduler.add_request(req, cache_salt)

    def finish_requests(self, seq_ids: list[str], reason: FinishReason) -> None:
        """End sequences wherever they are (an abort, a stop string); their blocks are free on
        return. Ones already finished are left as they are."""
        for seq_id in seq_ids:
            self.scheduler.finish_request(seq_id, reason)

    def has_unfinished_requests(self) -> bool:
        """Sequences waiting or running, or finished ones the worker has not heard of: one more
        (empty) step tells it, so what it keeps per request (a draft model's KV blocks among
        it) leaves with the request."""
        return (
            self.scheduler.has_unfinished_requests()
            or self.scheduler.has_finished_to_send
            or self._launched is not None
        )

    def step(self) -> list[RequestUpdate]:
        """One step: the updates of the step it ran, or with async scheduling of the step
        launched by the call before (its own step then runs on while this returns); those of
        the launched step come first where a call has both."""
        sched_out = self.scheduler.schedule()
        updates: list[RequestUpdate] = []
        if self.async_scheduling and sched_out.can_run_ahead and not sched_out.is_empty:
            self.executor.launch(sched_out)
            if self._launched is not None:
                updates = self.scheduler.update_from_output(self._launched, self.executor.collect())
            self._launched = sched_out
            return updates
        if self._launched is not None:  # the step before first: its tokens come before ours
            updates = self.scheduler.update_from_output(self._launched, self.executor.collect())
            self._launched = None
        if sched_out.is_empty and not (sched_out.finished_req_ids or sched_out.preempted_req_ids):
            runner_out = RunnerOutput(sampled_token_ids={})
        else:
            runner_out = self.executor.execute(sched_out)
        return updates + self.scheduler.update_from_output(sched_out, runner_out)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """The load now (call from the thread that steps it)."""
        sched, kv = self.scheduler, self.scheduler.kv
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.num_queried_tokens,
            prefix_cache_hits=kv.num_hit_tokens,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.pool.num_usable_blocks,
            spec_decode=dataclasses.replace(
                sched.spec, accepted_per_pos=list(sched.spec.accepted_per_pos)
            ),
            expert_tokens=self.executor.collective_rpc("router_stats"),
        )

    def shutdown(self) -> None:
        """Release the model and the KV cache; the core takes no more steps."""
        self.executor.shutdown()
