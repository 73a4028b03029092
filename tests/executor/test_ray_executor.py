"""Tensor parallelism through the Ray executor, on a local two-CPU Ray cluster: TP=2 (two
actors in a placement group) against TP=1 in process on the tiny random models, a rank
killed mid-run, the placement group gone at shutdown, and the arguments it refuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray", reason="ray could not be installed (pip install 'tokenmill[ray]')")

from conftest import assert_all_blocks_free  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.config import EngineArgs  # noqa: E402
from tokenmill.executor.multiproc import TensorParallelWorkerError  # noqa: E402
from tokenmill.executor.ray_executor import RayExecutor  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox jumps", "a"]
# As tests/executor/test_multiproc.py: fp32 on both sides, partial sums added in another order.
LOGPROB_TOL = 1e-4
NUM_CPUS = 2


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    """A local cluster of two CPUs (one a rank at TP=2), shared by the module's tests."""
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _llm(model: object, tp: int, **kwargs: object) -> LLM:
    return LLM(
        str(model), tensor_parallel_size=tp, kv_cache_memory="8MiB", max_model_len=256, **kwargs
    )


def _generate(llm: LLM) -> list:
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert_all_blocks_free(llm.engine)
        return outputs
    finally:
        llm.engine.shutdown()


def _wait_cpus_free(timeout: float = 10.0) -> float:
    """The cluster's free CPUs once they are all back (or the count at the deadline)."""
    deadline = time.monotonic() + timeout
    while (free := ray.available_resources().get("CPU", 0)) < NUM_CPUS:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return free


@pytest.mark.parametrize(("arch", "tp"), [("llama", 2), ("gemma3", 2), ("llama", 1)])
def test_ray_matches_in_process_tp1(tiny_model_dir, arch: str, tp: int) -> None:
    """llama: lm_head split by vocabulary; gemma3: tied, so the vocabulary-parallel embedding
    is the head too. TP=1 through Ray is one actor running the whole model."""
    model = tiny_model_dir(arch)
    expected = _generate(_llm(model, 1))
    llm = _llm(model, tp, distributed_executor="ray")
    executor = llm.engine.executor
    assert isinstance(executor, RayExecutor)
    assert len(executor.actors) == tp
    assert all(pid != os.getpid() for _, pid in executor.nodes)  # rank 0 is an actor too
    got = _generate(llm)
    for a, b in zip(expected, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert [t.token_id for t in pa.top] == [t.token_id for t in pb.top]
            for ta, tb in zip(pa.top, pb.top, strict=True):
                assert ta.logprob == pytest.approx(tb.logprob, abs=LOGPROB_TOL)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa.sampled.logprob == pytest.approx(pb.sampled.logprob, abs=LOGPROB_TOL)
    # shutdown killed the actors and removed the placement group: its CPUs are free again
    assert _wait_cpus_free() == NUM_CPUS


def test_async_scheduling_launches_on_every_actor(tiny_model_dir, monkeypatch) -> None:
    """Every actor is sent "launch" and later "collect": the tokens of TP=1 in process,
    stepping one at a time."""
    launched = []
    monkeypatch.setattr(
        RayExecutor,
        "launch",
        lambda self, s: launched.append(s) or self.collective_rpc("launch", s),
    )
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True),
    ]
    want = _llm(tiny_model_dir("llama"), 1)
    try:
        expected = [o.outputs[0].token_ids for o in want.generate(PROMPTS[:2], params)]
    finally:
        want.engine.shutdown()
    llm = _llm(tiny_model_dir("llama"), 2, distributed_executor="ray", async_scheduling=True)
    try:
        assert llm.engine.core.async_scheduling
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
        assert got == expected and len(launched) > 5
        assert_all_blocks_free(llm.engine)
    finally:
        llm.engine.shutdown()


def test_killed_actor_raises_within_seconds(tiny_model_dir) -> None:
    llm = _llm(tiny_model_dir("llama"), 2, distributed_executor="ray")
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        assert len(llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        _, pid = executor.nodes[1]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            TensorParallelWorkerError, match=rf"rank 1 \(Ray actor, pid {pid} .*died"
        ):
            llm.generate(["hello again"], SamplingParams(max_tokens=64), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.engine.shutdown()
    assert _wait_cpus_free() == NUM_CPUS  # rank 0, alive, was killed too


def test_bad_distributed_executor_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"distributed_executor must be one of mp, ray, torchrun; got 'slurm'"
    ):
        EngineArgs(distributed_executor="slurm")


def test_ranks_that_do_not_fit_the_cluster_are_refused(tiny_model_dir) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"needs 4 CPU \(2 a rank\); the Ray cluster has 2"):
        _llm(tiny_model_dir("llama"), 2, distributed_executor="ray", num_threads=2)
    assert time.monotonic() - start < 5  # refused before waiting on a placement group


def test_ray_is_imported_only_when_picked() -> None:
    code = (
        "import sys\n"
        "from tokenmill.config import EngineArgs\n"
        "from tokenmill.executor import create_executor\n"
        "import tokenmill.executor.multiproc\n"
        "EngineArgs(distributed_executor='ray')\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_engine_loaded_in_a_thread_starts_its_own_cluster(tiny_model_dir) -> None:
    """As the server does: the engine (and so a local Ray cluster) is loaded in a thread that
    ends. Ray's node processes die with the thread that started them unless the executor
    keeps one alive; the engine's own cluster stops at shutdown."""
    code = (
        "import sys, threading, time, ray\n"
        "from tokenmill import LLM\n"
        "from tokenmill.sampling_params import SamplingParams\n"
        "box = []\n"
        "def load():\n"
        "    box.append(LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor='ray',\n"
        "                   kv_cache_memory='8MiB', max_model_len=256, num_threads=1))\n"
        "t = threading.Thread(target=load)\n"
        "t.start(); t.join(); time.sleep(2)\n"
        "llm = box[0]\n"
        "params = SamplingParams(max_tokens=4, temperature=0.0)\n"
        "out = llm.generate(['hello'], params, use_tqdm=False)[0].outputs[0].token_ids\n"
        "assert len(out) == 4, out\n"
        "llm.engine.shutdown()\n"
        "assert not ray.is_initialized()\n"
        "print('OK')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dir("llama"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_ranks_spread_over_two_nodes_when_one_is_too_small(tiny_model_dir) -> None:
    """Two one-CPU Ray nodes (ray.cluster_utils.Cluster: two raylets on this machine): PACK
    puts the ranks on different nodes, and the tokens and logprobs are TP=1's."""
    model = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    llm = _llm(model, 1)
    try:
        expected = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    code = (
        "import json, sys, ray\n"
        "from ray.cluster_utils import Cluster\n"
        "from ray.util.placement_group import placement_group_table\n"
        "from tokenmill import LLM\n"
        "from tokenmill.sampling_params import SamplingParams\n"
        "cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 1})\n"
        "cluster.add_node(num_cpus=1)\n"
        "ray.init(address=cluster.address)\n"
        "llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor='ray',\n"
        "          kv_cache_memory='8MiB', max_model_len=256, num_threads=1)\n"
        "table = placement_group_table(llm.engine.executor.placement_group)\n"
        "params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)\n"
        "outs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)\n"
        "llm.engine.shutdown()\n"
        "ray.shutdown()\n"
        "cluster.shutdown()\n"
        "print(json.dumps(dict(\n"
        "    nodes=sorted(set(table['bundles_to_node_id'].values())),\n"
        "    tokens=[o.outputs[0].token_ids for o in outs],\n"
        "    logprobs=[[p.sampled.logprob for p in o.outputs[0].logprobs] for o in outs])))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model), json.dumps(PROMPTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["nodes"]) == 2  # one rank on each node
    assert got["tokens"] == [o.outputs[0].token_ids for o in expected]
    for lps, o in zip(got["logprobs"], expected, strict=True):
        want = [p.sampled.logprob for p in o.outputs[0].logprobs]
        assert lps == pytest.approx(want, abs=LOGPROB_TOL)
