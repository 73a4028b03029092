"""EngineCore: the scheduler and the executor. Sequences in, each step's RequestUpdates out.

It knows token ids only: no tokenizer, no text, no RequestOutputs. LLMEngine (llm_engine.py)
sits in front of it: it validates and tokenizes requests, and turns the updates into outputs
(detokenizing, stop strings), telling the core which sequences a stop string ended. All that
passes between the two is plain data (Request, RequestUpdate), so the core can run in a
process of its own, where the output side does not hold it up (core_process.py).

A step is schedule -> execute -> update_from_output. With async scheduling (on with CUDA) a
step that may run ahead is launched instead, and its updates returned by the next call, after
that call has scheduled and launched the step after it: the host's work for one step overlaps
the device's run of the other.

    call k:    schedule N+1 | launch N+1 | collect N -> update N
    device:    ... step N runs ...    | step N+1 runs ...
"""

from __future__ import annotations

import dataclasses

from tokenmill.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    SchedulerConfig,
    WorkerInfo,
    parse_memory,
)
from tokenmill.core import RunnerOutput, Scheduler, SchedulerOutput
from tokenmill.core.sched_output import RequestUpdate
from tokenmill.executor import Executor, create_executor
from tokenmill.outputs import EngineStats
from tokenmill.request import FinishReason, Request


class EngineCore:
    """Loads the model (the executor's workers), sizes the KV cache and allocates it: ``worker``
    says what was loaded, ``config`` how the core runs it. ValueError where the arguments
    cannot run (a KV cache too small for one request of max_model_len, ...)."""

    def __init__(self, args: EngineArgs) -> None:
        self.executor: Executor = create_executor(args)
        self.worker: WorkerInfo = self.executor.info
        self.config = engine_config(args, self.worker)
        self.executor.initialize(self.config.cache_config)
        self.scheduler = Scheduler(self.config.scheduler_config, self.config.cache_config)
        self.async_scheduling = self.worker.async_scheduling
        # Only then do the stats ask the workers (a round trip to every tensor-parallel rank,
        # and the stats are read after every step).
        self._router_stats = args.moe_router_stats
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

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv.num_free_blocks

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
            expert_tokens=(
                self.executor.collective_rpc("router_stats") if self._router_stats else None
            ),
        )

    def shutdown(self) -> None:
        """Release the model and the KV cache; the core takes no more steps."""
        self.executor.shutdown()


def engine_config(args: EngineArgs, worker: WorkerInfo) -> EngineConfig:
    """The engine's frozen config from the arguments and what the worker loaded; refuses a KV
    cache too small for one request of max_model_len."""
    layout = worker.kv_layout
    needed = layout.blocks_held(worker.max_model_len, args.block_size, args.max_num_batched_tokens)
    if needed > worker.num_kv_blocks - 1:
        tokens_that_fit = layout.max_request_tokens(
            worker.num_kv_blocks - 1, args.block_size, args.max_num_batched_tokens
        )
        raise ValueError(
            f"the KV cache holds {tokens_that_fit} tokens, fewer than max_model_len "
            f"({worker.max_model_len}); raise kv_cache_memory or lower max_model_len"
        )
    return EngineConfig(
        model_config=worker.model_config,
        cache_config=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=parse_memory(args.kv_cache_memory),
            # A hybrid model's recurrent state cannot be rebuilt from cached blocks
            # (attention/recurrent.py): every request computes from its first token.
            enable_prefix_caching=(
                args.enable_prefix_caching and worker.model_config.linear_attention is None
            ),
            num_blocks=worker.num_kv_blocks,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_layout=layout,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=worker.max_model_len,
        ),
        device=worker.device,
        dtype=worker.dtype,
        seed=args.seed,
        quantization=worker.quantization,
    )


def window_capacity(config: EngineConfig) -> str:
    """The memory plan's line for a layout with sliding windows: what a request holds."""
    cache, sched = config.cache_config, config.scheduler_config
    layout = cache.layout(config.model_config.num_kv_layers)
    held = layout.blocks_held(sched.max_model_len, cache.block_size, sched.max_num_batched_tokens)
    whole = layout.num_groups * -(-sched.max_model_len // cache.block_size)
    usable = cache.num_blocks - 1
    return (
        f"KV layout: {layout.describe()}. A request of max_model_len ({sched.max_model_len}) "
        f"holds at most {held} blocks (not {whole}), so {usable // held} of them fit at once, "
        f"not {usable // whole}"
    )
