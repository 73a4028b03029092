"""Scheduler driven by a fake worker (no torch, no model).

The fake worker keeps the KV cache as "which prefix of which sequence each slot holds", so every
step also checks that the block tables the scheduler sends (including prefix hits and resumed
requests) give each scheduled token exactly its own sequence's context.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core import RunnerOutput, Scheduler, SchedulerOutput
from tokenmill.core.sched_output import RequestUpdate
from tokenmill.kv_layout import KVLayout
from tokenmill.request import FinishReason, Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

EOS = 2
_ids = itertools.count()


def default_token(req_id: str, output_idx: int) -> int:
    """A deterministic token that depends on the request and position (never EOS)."""
    return 100 + (sum(map(ord, req_id)) * 7 + output_idx * 13) % 150


TokenFn = Callable[[str, int], int]


class FakeWorker:
    """Per group of layers (``group_windows``), a block table per request and a cache of
    "which prefix each slot holds"; every step checks that each scheduled token's context, as
    far as its group attends (all of it, or the window), holds that token's own sequence."""

    def __init__(
        self,
        block_size: int,
        token_fn: TokenFn = default_token,
        group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.group_windows = group_windows
        # id -> (tokens, block table per group)
        self.reqs: dict[str, tuple[list[int], list[list[int]]]] = {}
        self.num_prompt: dict[str, int] = {}
        # per group: slot -> the token prefix it encodes
        self.slots: list[dict[int, tuple[int, ...]]] = [{} for _ in group_windows]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(rid, None)
        computed: dict[str, int] = {}
        for new in out.new_reqs:
            assert new.req_id not in self.reqs
            assert len(new.block_ids) == len(self.group_windows)
            self.reqs[new.req_id] = (list(new.token_ids), [list(t) for t in new.block_ids])
            self.num_prompt[new.req_id] = new.num_prompt_tokens
            computed[new.req_id] = new.num_computed_tokens
        for cached in out.cached_reqs:
            for table, new_ids in zip(self.reqs[cached.req_id][1], cached.new_block_ids):
                table.extend(new_ids)
            computed[cached.req_id] = cached.num_computed_tokens
        assert set(computed) == set(out.num_scheduled_tokens)
        # Write every scheduled token's "KV", then check each request's context.
        for rid, n in out.num_scheduled_tokens.items():
            tokens, tables = self.reqs[rid]
            start = computed[rid]
            assert n >= 1 and start + n <= len(tokens)
            for g, blocks in enumerate(tables):
                assert len(blocks) * bs >= start + n, "block table too short"
                for pos in range(start, start + n):
                    assert blocks[pos // bs] != 0, "a token written into the null block"
                    self.slots[g][blocks[pos // bs] * bs + pos % bs] = tuple(tokens[: pos + 1])
        for rid, n in out.num_scheduled_tokens.items():
            tokens, tables = self.reqs[rid]
            for g, (blocks, window) in enumerate(zip(tables, self.group_windows)):
                # The step's first query sees the most keys before it.
                first = 0 if window is None else max(0, computed[rid] - window + 1)
                for pos in range(first, computed[rid] + n):
                    slot = blocks[pos // bs] * bs + pos % bs
                    assert self.slots[g].get(slot) == tuple(tokens[: pos + 1]), (rid, g, pos)
        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            tokens, _ = self.reqs[rid]
            if computed[rid] + n == len(tokens):
                token = self.token_fn(rid, len(tokens) - self.num_prompt[rid])
                tokens.append(token)
                sampled[rid] = [token]
        return RunnerOutput(sampled_token_ids=sampled)


def layout_of(group_windows: tuple[int | None, ...]) -> KVLayout:
    """A layout of one layer per group (the scheduler reads only the groups' windows)."""
    n = len(group_windows)
    return KVLayout(1, group_windows, tuple(range(n)), (0,) * n)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
    group_windows: tuple[int | None, ...] = (None,),
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
        CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_blocks=num_blocks,
            kv_layout=layout_of(group_windows),
        ),
    )


def make_request(
    num_prompt_tokens: int = 6,
    req_id: str | None = None,
    prompt: list[int] | None = None,
    wait_for_req_id: str | None = None,
    **params,
) -> Request:
    params.setdefault("max_tokens", 4)
    if prompt is None:
        start = 1000 * (next(_ids) + 1)
        prompt = list(range(start, start + num_prompt_tokens))
    return Request(
        req_id=req_id or f"r{next(_ids)}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        eos_token_ids=(EOS,),
        wait_for_req_id=wait_for_req_id,
    )


class Driver:
    """Runs steps and records what happened."""

    def __init__(self, sched: Scheduler, token_fn: TokenFn = default_token) -> None:
        self.sched = sched
        self.worker = FakeWorker(sched.kv.block_size, token_fn, sched.kv.group_windows)
        self.outputs: list[SchedulerOutput] = []
        self.finished: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_steps = 0

    def add(self, *reqs: Request) -> None:
        for req in reqs:
            self.sched.add_request(req)

    def step(self) -> list[RequestUpdate]:
        running = {r.req_id: r for r in self.sched.running + list(self.sched.waiting)}
        out = self.sched.schedule()
        self.outputs.append(out)
        self.num_steps += 1
        assert out.total_num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        assert self.sched.num_running <= self.sched.config.max_num_seqs
        updates = self.sched.update_from_output(out, self.worker.execute(out))
        for update in updates:
            self.tokens.setdefault(update.req_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                self.finished[update.req_id] = running[update.req_id]
        return updates

    def run(self, max_steps: int = 500) -> None:
        while self.sched.has_unfinished_requests():
            self.step()
            assert self.num_steps < max_steps, "the scheduler made no progress"
        # The worker learns about the last finished requests on the next (empty) step.
        last = self.sched.schedule()
        assert last.is_empty
        self.worker.execute(last)
        assert self.worker.reqs == {}


def assert_all_blocks_free(sched: Scheduler) -> None:
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def expected_tokens(req_id: str, n: int) -> list[int]:
    return [default_token(req_id, i) for i in range(n)]


# ---- token budget, chunked prefill, max_num_seqs, FCFS ------------------------------------------


def test_long_prompt_is_chunked_and_decodes_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    d = Driver(sched)
    long = make_request(40, max_tokens=6)
    d.add(long)
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {long.req_id: 16}
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {long.req_id: 16}
    assert d.tokens == {}  # mid-prompt chunks sample nothing
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {long.req_id: 8}
    assert len(d.tokens[long.req_id]) == 1
    # Now a second long prompt joins while the first decodes: 1 decode + a 15-token chunk.
    other = make_request(30, max_tokens=2)
    d.add(other)
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {other.req_id: 15, long.req_id: 1}
    assert [r.req_id for r in d.outputs[-1].new_reqs] == [other.req_id]
    assert [r.req_id for r in d.outputs[-1].cached_reqs] == [long.req_id]
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {long.req_id: 1, other.req_id: 15}
    d.run()
    assert d.tokens[long.req_id] == expected_tokens(long.req_id, 6)
    assert d.tokens[other.req_id] == expected_tokens(other.req_id, 2)
    assert all(o.total_num_scheduled_tokens <= 16 for o in d.outputs)
    assert_all_blocks_free(sched)


def test_many_prompts_fill_the_budget_exactly():
    sched = make_scheduler(max_num_batched_tokens=20)
    d = Driver(sched)
    reqs = [make_request(7, max_tokens=3) for _ in range(5)]
    d.add(*reqs)
    d.step()
    # 7 + 7 + 6: the third prompt is cut to what is left of the budget.
    assert list(d.outputs[0].num_scheduled_tokens.values()) == [7, 7, 6]
    d.run()
    for req in reqs:
        assert d.tokens[req.req_id] == expected_tokens(req.req_id, 3)
    assert_all_blocks_free(sched)


def test_max_num_seqs_and_fcfs():
    sched = make_scheduler(max_num_seqs=2)
    d = Driver(sched)
    reqs = [make_request(5, max_tokens=m) for m in (3, 5, 2, 2, 4)]
    d.add(*reqs)
    first_step: dict[str, int] = {}
    while sched.has_unfinished_requests():
        d.step()
        assert sched.num_running <= 2
        assert len(d.outputs[-1].num_scheduled_tokens) <= 2
        for r in d.outputs[-1].new_reqs:
            first_step.setdefault(r.req_id, d.num_steps)
    d.run()
    order = sorted(first_step, key=lambda rid: first_step[rid])
    assert order == [r.req_id for r in reqs]  # FCFS
    # The third request starts only when the first (3 tokens) has finished.
    assert first_step[reqs[2].req_id] == 4
    for req, m in zip(reqs, (3, 5, 2, 2, 4)):
        assert d.tokens[req.req_id] == expected_tokens(req.req_id, m)
        assert req.finish_reason == FinishReason.LENGTH
    assert_all_blocks_free(sched)


# ---- preemption ---------------------------------------------------------------------------------


def test_preempts_newest_running_request_and_resumes_it():
    # 6 usable blocks of 4 tokens; two requests that each grow to 8 + 12 = 20 tokens (5 blocks).
    sched = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    d = Driver(sched)
    old = make_request(8, max_tokens=12)
    new = make_request(8, max_tokens=12)
    late = make_request(2, max_tokens=2)
    d.add(old, new, late)
    preempted_at = None
    while sched.has_unfinished_requests():
        d.step()
        out = d.outputs[-1]
        if preempted_at is None and new.num_preemptions:
            preempted_at = d.num_steps
            assert new.status == RequestStatus.PREEMPTED
            assert old.status == RequestStatus.RUNNING
            assert list(sched.waiting) == [new, late]  # resumes before later arrivals
            assert new.req_id not in out.num_scheduled_tokens
            assert new.num_computed_tokens == 0
            assert out.preempted_req_ids == {new.req_id}
    d.run()
    assert preempted_at is not None
    assert old.num_preemptions == 0
    assert new.num_preemptions >= 1
    assert sched.num_preemptions == old.num_preemptions + new.num_preemptions
    # Resumed whole: prompt plus the outputs it had, with no computed tokens.
    resumed = [n for o in d.outputs for n in o.new_reqs if n.req_id == new.req_id][-1]
    assert len(resumed.token_ids) > 8
    assert resumed.token_ids[:8] == new.prompt_token_ids
    assert resumed.num_computed_tokens == 0
    for req in (old, new):
        assert d.tokens[req.req_id] == expected_tokens(req.req_id, 12)
        assert req.finish_reason == FinishReason.LENGTH
    assert d.tokens[late.req_id] == expected_tokens(late.req_id, 2)
    assert_all_blocks_free(sched)


def test_updates_carry_a_sequences_timing_when_it_changed():
    """The output side sees only updates: a sequence's first update with a token, its first
    after each preemption and its last carry its SeqTiming, the others none."""
    sched = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    d = Driver(sched)
    old, new = make_request(8, max_tokens=12), make_request(8, max_tokens=12)
    d.add(old, new)
    timings: dict[str, list[tuple[int, object]]] = {old.req_id: [], new.req_id: []}
    while sched.has_unfinished_requests():
        for update in d.step():
            if update.new_token_ids:
                timings[update.req_id].append((len(d.tokens[update.req_id]), update.timing))
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    for req in (old, new):
        sent = [(n, t) for n, t in timings[req.req_id] if t is not None]
        first, last = sent[0][1], sent[-1][1]
        assert sent[0][0] == 1 and first.first_token_time == req.first_token_time
        assert first.first_scheduled_time == req.first_scheduled_time
        assert sent[-1][0] == 12 and last.finished_time == req.finished_time is not None
        assert last.num_preemptions == req.num_preemptions
        # Between: one a preemption (the first token after it), no more.
        assert len(sent) == 2 + req.num_preemptions
        assert [t.num_preemptions for _, t in sent[1:-1]] == list(range(1, req.num_preemptions + 1))


def test_preemption_with_prefix_caching_resumes_from_cache():
    sched = make_scheduler(num_blocks=7, block_size=4)
    d = Driver(sched)
    old = make_request(8, max_tokens=12)
    new = make_request(8, max_tokens=12)
    d.add(old, new)
    d.run()
    assert new.num_preemptions >= 1
    resumed = [n for o in d.outputs for n in o.new_reqs if n.req_id == new.req_id][-1]
    # Its full blocks were still cached when it came back (the fake worker checked their content).
    assert resumed.num_computed_tokens > 0
    for req in (old, new):
        assert d.tokens[req.req_id] == expected_tokens(req.req_id, 12)
    assert_all_blocks_free(sched)


def test_many_requests_under_memory_pressure_all_finish():
    sched = make_scheduler(num_blocks=13, block_size=4, max_num_batched_tokens=10)
    d = Driver(sched)
    reqs = [make_request(3 + 5 * (i % 4), max_tokens=6 + i % 5) for i in range(10)]
    d.add(*reqs)
    d.run()
    assert sched.num_preemptions > 0
    assert sched.num_preemptions == sum(r.num_preemptions for r in reqs)
    for i, req in enumerate(reqs):
        assert d.tokens[req.req_id] == expected_tokens(req.req_id, 6 + i % 5)
    assert_all_blocks_free(sched)


# ---- stop conditions ----------------------------------------------------------------------------


def tokens_from(seq: list[int]) -> TokenFn:
    return lambda rid, idx: seq[idx] if idx < len(seq) else 150


def run_one(req: Request, token_fn: TokenFn, **sched_kwargs) -> Driver:
    sched = make_scheduler(**sched_kwargs)
    d = Driver(sched, token_fn)
    d.add(req)
    d.run()
    assert_all_blocks_free(sched)
    return d


def test_finish_on_eos():
    req = make_request(5, max_tokens=10)
    d = run_one(req, tokens_from([7, 8, EOS, 9]))
    assert d.tokens[req.req_id] == [7, 8, EOS]
    assert req.finish_reason == FinishReason.STOP
    assert req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    req = make_request(5, max_tokens=5, ignore_eos=True)
    d = run_one(req, tokens_from([7, EOS, EOS, 9]))
    assert d.tokens[req.req_id] == [7, EOS, EOS, 9, 150]
    assert req.finish_reason == FinishReason.LENGTH


def test_finish_on_stop_token_id():
    req = make_request(5, max_tokens=10, stop_token_ids=[9, 11])
    d = run_one(req, tokens_from([7, 8, 11, 9]))
    assert d.tokens[req.req_id] == [7, 8, 11]
    assert req.finish_reason == FinishReason.STOP
    assert req.stop_reason == 11


def test_finish_on_max_tokens():
    req = make_request(5, max_tokens=3)
    d = run_one(req, tokens_from([7, 8, 9, 10]))
    assert d.tokens[req.req_id] == [7, 8, 9]
    assert req.finish_reason == FinishReason.LENGTH


def test_min_tokens_ignores_eos_and_stop_ids_before_it():
    req = make_request(5, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    d = run_one(req, tokens_from([EOS, 9, EOS, 8]))
    assert d.tokens[req.req_id] == [EOS, 9, EOS]
    assert req.finish_reason == FinishReason.STOP
    req = make_request(5, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    d = run_one(req, tokens_from([EOS, 9, 8, 9]))
    assert d.tokens[req.req_id] == [EOS, 9, 8, 9]
    assert req.stop_reason == 9


def test_finish_at_max_model_len():
    req = make_request(15, max_tokens=100)
    d = run_one(req, tokens_from([]), max_model_len=20)
    assert len(d.tokens[req.req_id]) == 5
    assert req.num_tokens == 20
    assert req.finish_reason == FinishReason.LENGTH


def test_finished_request_is_reported_to_the_worker():
    sched = make_scheduler()
    d = Driver(sched)
    req = make_request(5, max_tokens=1)
    d.add(req)
    updates = d.step()
    assert updates[0].finish_reason == FinishReason.LENGTH
    assert req.req_id not in sched.requests
    assert sched.schedule().finished_req_ids == {req.req_id}
    assert_all_blocks_free(sched)


# ---- abort --------------------------------------------------------------------------------------


def test_finish_request_from_waiting():
    sched = make_scheduler(max_num_seqs=1)
    d = Driver(sched)
    first, second = make_request(5), make_request(5)
    d.add(first, second)
    d.step()
    assert second.status == RequestStatus.WAITING
    assert sched.finish_request(second.req_id, FinishReason.ABORT) is second
    assert second.status == RequestStatus.FINISHED
    assert second.finish_reason == FinishReason.ABORT
    assert second not in sched.waiting
    assert sched.finish_request(second.req_id, FinishReason.ABORT) is None  # already gone
    d.run()
    assert second.req_id not in d.tokens
    assert d.tokens[first.req_id] == expected_tokens(first.req_id, 4)
    assert_all_blocks_free(sched)


def test_finish_request_from_running_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=33)
    d = Driver(sched)
    victim, other = make_request(10, max_tokens=20), make_request(10, max_tokens=5)
    d.add(victim, other)
    d.step()
    d.step()
    held_by_other = len(sched.kv.block_ids(other.req_id)[0])
    assert len(sched.kv.block_ids(victim.req_id)[0]) == 3
    sched.finish_request(victim.req_id, FinishReason.ABORT)
    assert sched.kv.block_ids(victim.req_id) == [[]]
    assert sched.kv.num_free_blocks == 32 - held_by_other
    assert victim not in sched.running
    assert victim.finish_reason == FinishReason.ABORT
    d.step()
    assert victim.req_id in d.outputs[-1].finished_req_ids
    d.run()
    assert d.tokens[other.req_id] == expected_tokens(other.req_id, 5)
    assert len(d.tokens[victim.req_id]) == 2
    assert_all_blocks_free(sched)


def test_finish_request_of_a_preempted_request():
    sched = make_scheduler(num_blocks=7, block_size=4, enable_prefix_caching=False)
    d = Driver(sched)
    old, new = make_request(8, max_tokens=12), make_request(8, max_tokens=12)
    d.add(old, new)
    while not new.num_preemptions:
        d.step()
    assert new.status == RequestStatus.PREEMPTED
    assert sched.finish_request(new.req_id, FinishReason.ABORT) is new
    assert new not in sched.waiting
    d.run()
    assert d.tokens[old.req_id] == expected_tokens(old.req_id, 12)
    assert_all_blocks_free(sched)


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request(3, req_id="x"))
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(make_request(3, req_id="x"))
    sched.finish_request("x", FinishReason.ABORT)
    assert_all_blocks_free(sched)


# ---- prefix caching and n > 1 siblings ----------------------------------------------------------


def test_second_request_hits_the_first_ones_blocks():
    sched = make_scheduler()
    d = Driver(sched)
    prompt = list(range(500, 517))  # 17 tokens: 4 full blocks
    first = make_request(prompt=prompt)
    d.add(first)
    d.run()
    second = make_request(prompt=prompt)
    d.add(second)
    d.step()
    (new,) = d.outputs[-1].new_reqs
    assert new.num_computed_tokens == 16
    assert d.outputs[-1].num_scheduled_tokens == {second.req_id: 1}
    assert second.num_cached_tokens == 16
    d.run()
    assert sched.kv.num_hit_tokens == 16
    assert_all_blocks_free(sched)


def test_siblings_wait_for_the_leader_prompt_then_hit_its_blocks():
    sched = make_scheduler(max_num_batched_tokens=8)
    d = Driver(sched)
    prompt = list(range(700, 717))  # 17 tokens: chunked over 3 steps at 8 per step
    leader = make_request(prompt=prompt, req_id="g", max_tokens=3)
    sib1 = make_request(prompt=prompt, req_id="g#1", wait_for_req_id="g", max_tokens=3)
    sib2 = make_request(prompt=prompt, req_id="g#2", wait_for_req_id="g", max_tokens=3)
    d.add(leader, sib1, sib2)
    for _ in range(3):
        d.step()
        assert set(d.outputs[-1].num_scheduled_tokens) == {"g"}
        assert sib1.status == sib2.status == RequestStatus.WAITING
    assert leader.num_computed_tokens == 17
    d.step()
    out = d.outputs[-1]
    assert [n.req_id for n in out.new_reqs] == ["g#1", "g#2"]
    (leader_blocks,) = sched.kv.block_ids("g")
    for new in out.new_reqs:
        assert new.num_computed_tokens == 16
        assert new.block_ids[0][:4] == leader_blocks[:4]
    assert out.num_scheduled_tokens == {"g#1": 1, "g#2": 1, "g": 1}
    d.run()
    for req in (leader, sib1, sib2):
        assert d.tokens[req.req_id] == expected_tokens(req.req_id, 3)
    assert sib1.num_cached_tokens == sib2.num_cached_tokens == 16
    assert_all_blocks_free(sched)


def test_blocked_sibling_does_not_block_later_requests():
    sched = make_scheduler(max_num_batched_tokens=12)
    d = Driver(sched)
    prompt = list(range(800, 820))
    leader = make_request(prompt=prompt, req_id="L", max_tokens=2)
    sib = make_request(prompt=prompt, req_id="L#1", wait_for_req_id="L", max_tokens=2)
    other = make_request(3, max_tokens=2)
    d.add(leader, sib, other)
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {"L": 12}
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {"L": 8, other.req_id: 3}
    assert list(sched.waiting) == [sib]  # still first in line
    d.run()
    assert_all_blocks_free(sched)


def test_siblings_do_not_wait_without_prefix_caching():
    sched = make_scheduler(enable_prefix_caching=False)
    d = Driver(sched)
    prompt = list(range(900, 910))
    d.add(
        make_request(prompt=prompt, req_id="a", max_tokens=2),
        make_request(prompt=prompt, req_id="a#1", wait_for_req_id="a", max_tokens=2),
    )
    d.step()
    assert d.outputs[-1].num_scheduled_tokens == {"a": 10, "a#1": 10}
    d.run()
    assert_all_blocks_free(sched)


def test_cache_salt_prevents_sharing_between_requests():
    sched = make_scheduler()
    d = Driver(sched)
    prompt = list(range(600, 609))
    sched.add_request(make_request(prompt=prompt), cache_salt="tenant-a")
    d.run()
    b = make_request(prompt=prompt)
    sched.add_request(b, cache_salt="tenant-b")
    d.step()
    assert d.outputs[-1].new_reqs[0].num_computed_tokens == 0
    d.run()
    c = make_request(prompt=prompt)
    sched.add_request(c, cache_salt="tenant-a")
    d.step()
    assert d.outputs[-1].new_reqs[0].num_computed_tokens == 8
    d.run()
    assert sched.cache_salts == {}
    assert_all_blocks_free(sched)


# ---- randomized: shared prefixes, memory pressure, aborts ----------------------------------------


@pytest.mark.parametrize("group_windows", [(None,), (None, 7, 7), (5,)], ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_keeps_every_invariant(seed, group_windows):
    """Random prompts with shared prefixes, n = 2 groups, tight memory and budgets, aborts; the
    fake worker checks every block table, and every request ends with the right tokens. (Over
    these seeds, one group without a window: preemptions in 7 of 8 runs, prefix hits in 6, 5 to
    12 aborts each.) Also with window groups beside a full one (Gemma), and every layer
    windowed (Mistral)."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_model_len = 48
    max_num_batched_tokens = rng.choice([5, 16, 64])
    layout = layout_of(group_windows)
    one_request = layout.blocks_held(max_model_len, block_size, max_num_batched_tokens)
    num_blocks = one_request + 1 + rng.randrange(0, 12 * len(group_windows))
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.8,
        group_windows=group_windows,
    )
    d = Driver(sched)
    shared = [rng.randrange(3, 60) for _ in range(20)]
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    for step in range(400):
        if step < 40 and rng.random() < 0.5:
            prompt = shared[: rng.randrange(0, 20)] + [rng.randrange(3, 60) for _ in range(5)]
            prompt = prompt[: rng.randrange(1, len(prompt) + 1)]
            max_tokens = rng.randrange(1, max_model_len - len(prompt) + 1)
            req = make_request(prompt=prompt, max_tokens=max_tokens)
            n = rng.choice([1, 1, 2])
            d.add(req)
            expected[req.req_id] = max_tokens
            for i in range(1, n):
                sib = make_request(
                    prompt=prompt,
                    req_id=f"{req.req_id}#{i}",
                    wait_for_req_id=req.req_id,
                    max_tokens=max_tokens,
                )
                d.add(sib)
                expected[sib.req_id] = max_tokens
        if sched.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_request(victim, FinishReason.ABORT)
            aborted.add(victim)
        if not sched.has_unfinished_requests() and step >= 40:
            break
        d.step()
        # Every block is either free or held by a running request; waiting ones hold none.
        held = [b for r in sched.running for t in sched.kv.block_ids(r.req_id) for b in t if b != 0]
        assert sched.kv.num_free_blocks + len(set(held)) == sched.kv.pool.num_usable_blocks
        assert all(not any(sched.kv.block_ids(r.req_id)) for r in sched.waiting)
    d.run()
    assert set(expected) - aborted == set(d.finished) - aborted
    for rid, max_tokens in expected.items():
        if rid not in aborted:
            assert d.tokens[rid] == expected_tokens(rid, max_tokens), rid
    assert_all_blocks_free(sched)


def _draft_scheduler(max_model_len: int = 64, budget: int = 64) -> tuple[Scheduler, Request]:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len),
        CacheConfig(block_size=4, num_blocks=16),
    )
    req = Request("a", list(range(10, 20)), SamplingParams(max_tokens=20), eos_token_ids=(EOS,))
    sched.add_request(req)
    req.draft_token_ids = [1, 2]  # mid-prefill: not a decode, so the drafts are dropped
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10} and out.draft_token_ids == {}
    sched.update_from_output(out, RunnerOutput({"a": [50]}))
    return sched, req


def test_drafts_run_with_a_decode_and_rejected_ones_are_taken_back() -> None:
    sched, req = _draft_scheduler()
    req.draft_token_ids = [51, 52, 53]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.draft_token_ids == {"a": [51, 52, 53]}
    assert req.draft_token_ids == []  # a proposal runs once
    assert len(sched.kv.block_ids("a")[0]) == 4  # room for 10 + 1 + 3 tokens
    # 51 accepted, 52 rejected: the model's 60 instead; 53 never counted.
    sched.update_from_output(out, RunnerOutput({"a": [51, 60]}))
    assert req.output_token_ids == [50, 51, 60]
    assert req.num_computed_tokens == 12  # the prompt, 50 and 51; 60 runs next
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_reqs[0].num_computed_tokens == 12


def test_drafts_are_cut_to_the_context_and_the_budget() -> None:
    sched, req = _draft_scheduler(max_model_len=13)
    req.draft_token_ids = [51, 52, 53, 54]
    out = sched.schedule()  # 11 tokens known: room for 2 more positions
    assert out.draft_token_ids == {"a": [51, 52]}
    sched, req = _draft_scheduler(budget=10)
    req.draft_token_ids = [51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10} and len(out.draft_token_ids["a"]) == 9


# ---- async scheduling: the next step scheduled before this one's tokens are in --------------


def test_async_order_runs_the_pending_token_and_stops_at_max_tokens():
    sched = make_scheduler()
    req = make_request(5, max_tokens=3, ignore_eos=True)
    sched.add_request(req)
    first = sched.schedule()  # the prompt, which samples output 1
    assert first.num_scheduled_tokens == {req.req_id: 5} and first.can_run_ahead
    second = sched.schedule()  # output 1, not yet known: its id is on the device
    assert second.num_scheduled_tokens == {req.req_id: 1}
    assert req.num_pending_tokens == 2
    sched.update_from_output(first, RunnerOutput({req.req_id: [7]}))
    third = sched.schedule()  # output 2; output 3 (sampled by this step) is the last
    assert third.num_scheduled_tokens == {req.req_id: 1}
    sched.update_from_output(second, RunnerOutput({req.req_id: [8]}))
    assert sched.schedule().is_empty  # its pending token is its last: nothing more to run
    (update,) = sched.update_from_output(third, RunnerOutput({req.req_id: [9]}))
    assert update.finish_reason == FinishReason.LENGTH
    assert req.output_token_ids == [7, 8, 9] and req.num_pending_tokens == 0
    assert_all_blocks_free(sched)


def test_async_order_drops_the_token_after_a_stop():
    sched = make_scheduler()
    req = make_request(5, max_tokens=10, stop_token_ids=[7])
    sched.add_request(req)
    first = sched.schedule()
    second = sched.schedule()  # runs ahead: the stop is not known yet
    (update,) = sched.update_from_output(first, RunnerOutput({req.req_id: [7]}))
    assert update.finish_reason == FinishReason.STOP
    assert_all_blocks_free(sched)  # freed at once: the device runs the steps in order
    assert sched.schedule().finished_req_ids == {req.req_id}
    assert sched.update_from_output(second, RunnerOutput({req.req_id: [8]})) == []
    assert req.output_token_ids == [7]


def test_requests_that_sample_from_their_tokens_do_not_run_ahead():
    for params in (dict(logprobs=1), dict(prompt_logprobs=0), dict(repetition_penalty=1.2)):
        sched = make_scheduler()
        sched.add_request(make_request(5))
        sched.add_request(make_request(5, **params))
        assert not sched.schedule().can_run_ahead
