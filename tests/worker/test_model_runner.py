"""Steps with several query tokens per request (worker/model_runner.py, worker/input_batch.py).

A decoding request scheduled for its next known token plus K draft tokens must see at each of
its 1 + K rows the logits that K + 1 single-token decode steps give (fp32; 1e-4: the two run
different attention paths, SDPA over gathered blocks and the paged decode kernel), whatever
else shares the step. Through the engine, drafts never change greedy output: right ones are
kept, a wrong one is replaced by the model's token, and the KV blocks all come back.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill.config import CacheConfig, EngineArgs
from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner, accept_drafts
from tokenmill.worker.worker import Worker, resolve_worker_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPT = [1, *range(40, 60)]  # 21 tokens: the drafts cross a block boundary (block size 16)
KNOWN_NEXT = 77  # the request's last known token (an output so far)
DRAFTS = [90, 12, 300, 5]
BLOCK_SIZE = 16


def make_runner(tiny_model_dir, arch: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    """The worker's runner, in the worker's KV layout: the tiny gemma3 (window 24 in 5 of its 6
    layers) has a block table per layer, 6 groups."""
    args = EngineArgs(model=str(tiny_model_dir(arch)), max_model_len=128, kv_cache_memory="4MiB")
    worker = Worker(resolve_worker_config(args))
    cache = CacheConfig(
        block_size=BLOCK_SIZE,
        num_blocks=32,
        kv_cache_dtype=kv_cache_dtype,
        kv_layout=worker.kv_layout,
    )
    worker.initialize(cache)
    assert worker.runner is not None
    return worker.runner


def tables(runner: ModelRunner, block_ids: list[int]) -> list[list[int]]:
    """A block table per group: group g's blocks are ``block_ids`` + 5 g (below 32 for 6)."""
    return [[b + 5 * g for b in block_ids] for g in range(runner.kv_layout.num_groups)]


def new_req(runner, req_id: str, token_ids: list[int], block_ids: list[int], num_computed=0):
    blocks = tables(runner, block_ids)
    return NewRequestData(req_id, token_ids, len(PROMPT), GREEDY, blocks, num_computed)


def step_logits(runner: ModelRunner, sched: SchedulerOutput) -> tuple[list, torch.Tensor]:
    runner.update_states(sched)
    step = runner.prepare_step(sched)
    logits = runner.compute_logits(runner.forward(step), step).clone()
    return step.reqs, logits


@pytest.mark.parametrize(
    ("arch", "kv_cache_dtype"), [("llama", "auto"), ("gemma3", "auto"), ("qwen3", "int8")]
)
def test_one_plus_k_rows_give_the_logits_of_k_plus_1_single_steps(
    tiny_model_dir, arch, kv_cache_dtype
) -> None:
    runner = make_runner(tiny_model_dir, arch, kv_cache_dtype)
    assert runner.kv_layout.num_groups == (6 if arch == "gemma3" else 1)
    known = PROMPT + [KNOWN_NEXT]
    prefill = {"a": len(PROMPT), "b": len(PROMPT)}
    runner.execute(  # both prompts into the cache; mid-known tokens: nothing sampled
        SchedulerOutput(
            [new_req(runner, "a", known, [1, 2]), new_req(runner, "b", known, [3, 4])],
            [],
            prefill,
        )
    )
    # "a": its next token and 4 drafts in one step, beside a one-token decode of "c".
    c_tokens = [1, 2, 3]
    sched = SchedulerOutput(
        new_reqs=[new_req(runner, "c", c_tokens, [5], num_computed=2)],
        cached_reqs=[CachedRequestData("a", tables(runner, []), len(PROMPT))],
        num_scheduled_tokens={"c": 1, "a": 1 + len(DRAFTS)},
        draft_token_ids={"a": DRAFTS},
    )
    reqs, multi = step_logits(runner, sched)
    assert [(r.req_id, r.query_len, r.num_logits) for r in reqs] == [("c", 1, 1), ("a", 5, 5)]
    assert multi.shape[0] == 1 + len(DRAFTS) + 1
    # "b": the same tokens one decode step each.
    singles = []
    for j in range(len(DRAFTS) + 1):
        tokens = known + DRAFTS[:j]
        sched = SchedulerOutput(
            new_reqs=[new_req(runner, f"b{j}", tokens, [3, 4], num_computed=len(tokens) - 1)],
            cached_reqs=[],
            num_scheduled_tokens={f"b{j}": 1},
            finished_req_ids={f"b{j - 1}"} if j else {"b"},
        )
        reqs, logits = step_logits(runner, sched)
        assert reqs[0].query_len == 1 and logits.shape[0] == 1
        singles.append(logits[0])
    torch.testing.assert_close(multi[1:], torch.stack(singles), atol=1e-4, rtol=1e-4)


def test_accept_drafts_keeps_samples_up_to_the_first_disagreement() -> None:
    assert accept_drafts([7], []) == [7]
    assert accept_drafts([4, 5, 6], [4, 5]) == [4, 5, 6]  # all kept, plus the next sample
    assert accept_drafts([4, 9, 6], [4, 5]) == [4, 9]  # 5 rejected: the model's 9 instead
    assert accept_drafts([3, 5, 6], [4, 5]) == [3]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    args = EngineArgs(model=str(tiny_model_dir("llama")), max_model_len=96, kv_cache_memory="4MiB")
    return LLMEngine(args)


def run_with_drafts(engine: LLMEngine, prompts, propose) -> tuple[list[list[int]], int]:
    """Generate greedily; before each step, ``propose(prompt index, tokens so far)`` sets each
    running request's drafts. Returns the outputs and the number of steps."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    out: dict[str, list[int]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        for req in engine.scheduler.running:
            req.draft_token_ids = propose(index[req.req_id], req.output_token_ids)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
        num_steps += 1
    return [out[i] for i in ids], num_steps


def test_drafts_never_change_greedy_output(engine) -> None:
    prompts = [[1, *range(5 + 7 * i, 30 + 7 * i)] for i in range(3)]
    plain, plain_steps = run_with_drafts(engine, prompts, lambda i, out: [])

    def right_then_wrong(i: int, out: list[int]) -> list[int]:
        """The next 3 true tokens, the second of them wrong every other step."""
        drafts = plain[i][len(out) : len(out) + 3]
        if len(out) % 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 384
        return drafts

    drafted, drafted_steps = run_with_drafts(engine, prompts, right_then_wrong)
    assert drafted == plain
    assert drafted_steps < 0.75 * plain_steps  # 2 to 4 tokens a step
    assert_all_blocks_free(engine)
