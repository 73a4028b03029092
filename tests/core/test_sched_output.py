"""The scheduler's output as it crosses to the other tensor-parallel ranks: pickled with its
running requests as columns, it comes back equal."""

from __future__ import annotations

import pickle

from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


def test_a_scheduler_output_pickles_back_equal() -> None:
    new = NewRequestData(
        "a", [1, 2, 3], 3, SamplingParams(max_tokens=4, seed=1), [[0], [1]], 0, eos_token_ids=(2,)
    )
    cached = [CachedRequestData("b", [[], [7]], 40), CachedRequestData("c", ((), ()), 12)]
    out = SchedulerOutput(
        [new],
        cached,
        {"a": 3, "b": 3, "c": 1},
        finished_req_ids={"d"},
        preempted_req_ids={"e"},
        draft_token_ids={"b": [5, 6]},
        can_run_ahead=False,
    )
    back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == out
    assert [type(r) for r in back.cached_reqs] == [CachedRequestData] * 2
    assert back.num_computed_tokens() == {"a": 0, "b": 40, "c": 12}
