"""``tokenmill bench serve`` against a real tokenmill server on loopback: its figures agree with
the server's own /metrics and usage; failures, chat, shared prefixes, sweeps and plots."""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

# The loopback server of the server tests (tests/server has no conftest to share it through).
sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from live_server import MODEL_NAME, running_server, scrape  # noqa: E402

from tokenmill.bench.datasets import DatasetSpec, sample_requests  # noqa: E402
from tokenmill.bench.metrics import calculate_metrics  # noqa: E402
from tokenmill.bench.serve import (  # noqa: E402
    ServeConfig,
    arrival_offsets,
    error_text,
    run_serve_benchmark,
)
from tokenmill.cli import main  # noqa: E402
from tokenmill.tokenizer import load_tokenizer  # noqa: E402

TTFT = "tokenmill:time_to_first_token_seconds"
GEN = "tokenmill:generation_tokens_total"
PROMPT = "tokenmill:prompt_tokens_total"
HITS = "tokenmill:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny llama with a word-level tokenizer ("w3" ... "w383"): every token decodes to
    text at once, so each output token is one content chunk (a byte-level tokenizer's random
    bytes are held back while they are not yet UTF-8, moving the client's first chunk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    src, dst = tiny_model_dir("llama"), tmp_path_factory.mktemp("tiny-words")
    for f in src.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 384)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    return dst


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir, "llama")


def _delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _bench(url: str, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", url, "--disable-tqdm", "--result-json", str(out)]
    assert main([*argv, *flags]) == 0
    return json.loads(out.read_text())


def test_ttft_and_tokens_agree_with_the_servers_metrics(server, tokenizer):
    spec = DatasetSpec(num_prompts=8, input_len=32, output_len=8, seed=1)
    dataset = sample_requests(spec, tokenizer)
    before = scrape(server.url)
    # One at a time: the server's clock starts when its handler has the request, so a burst
    # of requests would add the time each waits for the event loop (not what is compared).
    cfg = ServeConfig(server.url, max_concurrency=1, progress=False)
    outcome = run_serve_benchmark(cfg, dataset, tokenizer)
    server.wait_idle()
    after = scrape(server.url)
    results, test = outcome.results, outcome.test_result

    assert outcome.model == MODEL_NAME  # from GET /v1/models
    assert all(r.success for r in results)
    # ignore_eos + max_tokens: exactly the asked length, as the server's usage says.
    assert [r.output_len for r in results] == [8] * 8
    assert {r.output_len_source for r in results} == {"usage"}
    assert {r.prompt_len_source for r in results} == {"usage"}
    # The server counts the same tokens (plus the uncounted test request's).
    assert _delta(before, after, GEN) == 8 * 8 + test.output_len == 66
    prompts = sum(r.prompt_len for r in results)
    assert _delta(before, after, PROMPT) == prompts + test.prompt_len
    # usage.prompt_tokens is the server's tokenization: BOS + the text's tokens.
    assert [r.prompt_len for r in results] == [
        len(tokenizer.encode(req.prompt)) for req in dataset.requests
    ]
    # TTFT: the server's arrival -> first token is inside the client's send -> first chunk,
    # and on loopback the two differ by little (HTTP, SSE framing, tokenization).
    assert _delta(before, after, TTFT + "_count") == 9
    client = sum(r.ttft for r in results) + test.ttft
    served = _delta(before, after, TTFT + "_sum")
    assert served <= client <= served + 9 * 0.05
    # Each output its own chunk: the client's pooled ITL gaps are the server's. (A token a
    # chunk, unless the server was too busy to send each: then those that queued come as one.)
    num_chunks = [len(r.chunk_times) for r in results]
    assert all(1 <= n <= 8 for n in num_chunks) and sum(num_chunks) > 8
    itl = "tokenmill:inter_token_latency_seconds"
    num_gaps = sum(n - 1 for n in num_chunks) + len(test.chunk_times) - 1
    assert _delta(before, after, itl + "_count") == num_gaps
    client_itl = sum(sum(r.itl) for r in results)
    assert client_itl == pytest.approx(_delta(before, after, itl + "_sum") - sum(test.itl), abs=0.5)
    metrics = calculate_metrics(results, outcome.duration_s)
    assert metrics.total_output_tokens == 64
    assert metrics.ttft_ms.mean == pytest.approx(np.mean([r.ttft for r in results]) * 1000)


def test_cli_writes_the_documented_json(server, tmp_path, capsys):
    before = scrape(server.url)
    doc = _bench(
        server.url, tmp_path,
        "--num-prompts", "6", "--input-len", "24", "--output-len", "5",
        "--request-rate", "50", "--seed", "3", "--goodput", "ttft:60000", "tpot:60000",
        "--hardware-cost-per-hour", "2.5",
    )  # fmt: skip
    server.wait_idle()
    after = scrape(server.url)
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table
    assert doc["schema_version"] == 1 and doc["kind"] == "serve"
    (run,) = doc["runs"]
    assert run["model"] == MODEL_NAME and run["backend"] == "openai-completions"
    assert (run["completed"], run["failed"], run["errors"]) == (6, 0, [])
    assert run["total_output_tokens"] == 30
    assert _delta(before, after, GEN) == 30 + 2  # + the test request's 2 tokens
    assert run["output_len_source"] == "usage"
    assert run["dataset"]["length_unit"] == "words"  # no --tokenizer
    assert run["load"] == {"request_rate": 50.0, "burstiness": 1.0, "max_concurrency": None}
    # Generous SLOs: every request is good.
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])
    assert run["output_throughput"] == pytest.approx(30 / run["duration_s"])
    cost = run["cost"]
    assert cost["usd_per_million_output_tokens"] == pytest.approx(
        2.5 / (run["output_throughput"] * 3600) * 1e6
    )
    assert [r["output_len"] for r in run["requests"]] == [5] * 6
    starts = [r["start_s"] for r in run["requests"]]
    # Requests were sent at the seeded Poisson arrival times (not all at once).
    np.testing.assert_allclose(starts, arrival_offsets(6, 50.0, 1.0, 3), atol=0.05)


def test_requests_the_server_refuses_are_counted_with_their_errors(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    fits, too_long = "a b c d e f", "w7 " * 300  # the server's context is 256 tokens
    rows = [{"prompt": fits}, {"prompt": too_long}, {"prompt": fits}, {"prompt": too_long}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = _bench(server.url, tmp_path, "--dataset", "jsonl", str(data), "--output-len", "4",
                 "--num-prompts", "4")  # fmt: skip
    (run,) = doc["runs"]
    assert (run["completed"], run["failed"]) == (2, 2)
    ((error,),) = [[e] for e in run["errors"]]
    assert error["count"] == 2
    assert error["error"].startswith("HTTP 400: ") and "256" in error["error"]
    assert run["total_output_tokens"] == 8  # failed requests count no tokens
    failed = [r for r in run["requests"] if not r["success"]]
    assert [r["chunk_times_s"] for r in failed] == [[], []]


def test_chat_endpoint(server, tmp_path):
    before = scrape(server.url)
    doc = _bench(server.url, tmp_path, "--endpoint", "chat", "--num-prompts", "4",
                 "--input-len", "16", "--output-len", "6")  # fmt: skip
    server.wait_idle()
    after = scrape(server.url)
    (run,) = doc["runs"]
    assert run["backend"] == "openai-chat" and run["completed"] == 4
    assert [r["output_len"] for r in run["requests"]] == [6] * 4
    assert _delta(before, after, GEN) == 24 + 2
    # The chat template's tokens are in the server's prompt count.
    assert run["total_input_tokens"] == _delta(before, after, PROMPT) - _test_prompt_len(server)
    assert run["total_input_tokens"] > 4 * 16


def _test_prompt_len(server) -> int:
    """Prompt tokens of the chat test request ("Hello"), as the server counts them."""
    import httpx

    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 1}  # fmt: skip
    return httpx.post(f"{server.url}/v1/chat/completions", json=body).json()["usage"][
        "prompt_tokens"
    ]


def test_shared_prefix_hits_the_prefix_cache(server, model_dir, tmp_path):
    before = scrape(server.url)
    doc = _bench(server.url, tmp_path, "--dataset", "shared-prefix", "--prefix-len", "96",
                 "--input-len", "8", "--output-len", "2", "--num-prompts", "5",
                 "--max-concurrency", "1", "--tokenizer", str(model_dir))  # fmt: skip
    server.wait_idle()
    after = scrape(server.url)
    (run,) = doc["runs"]
    assert run["completed"] == 5 and run["dataset"]["length_unit"] == "tokens"
    # One at a time: each later request finds at least the prefix's whole blocks
    # (96 tokens + BOS: 6 blocks of 16) cached.
    assert _delta(before, after, HITS) >= 4 * 96


def test_sweep_writes_one_result_per_concurrency_and_a_png(server, tmp_path):
    png = tmp_path / "sweep.png"
    doc = _bench(server.url, tmp_path, "--sweep-concurrency", "1,3", "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "3", "--hardware-cost-per-hour", "1",
                 "--plot", str(png))  # fmt: skip
    assert [r["load"]["max_concurrency"] for r in doc["runs"]] == [1, 3]
    assert [r["completed"] for r in doc["runs"]] == [3, 3]
    assert _png_size(png) == (1200, 500)


def test_plot_of_one_run(server, tmp_path):
    png = tmp_path / "run.png"
    _bench(server.url, tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
           "--plot", str(png))  # fmt: skip
    assert _png_size(png) == (1100, 800)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert len(data) > 10_000  # axes, curves and text, not an empty image
    return struct.unpack(">II", data[16:24])


def test_plot_without_matplotlib_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", "x.png"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "tokenmill: error: --plot needs matplotlib: pip install 'tokenmill[bench]'\n"
    )


@pytest.mark.parametrize(
    ("content", "dataset", "message"),
    [
        ("{not json", "sharegpt", "is not JSON"),
        ('{"conversations": []}', "sharegpt", "is not a JSON list"),
        ('[{"conversations": [{"from": "gpt", "value": "hi"}]}]', "sharegpt", "no conversation"),
        ('{"prompt": "ok"}\n[1, 2]\n', "jsonl", ":2: want"),
        ('{"prompt": "ok", "output_len": 0}\n', "jsonl", "output_len must be"),
    ],
)
def test_bad_dataset_file_exits_2_with_one_line(tmp_path, capsys, content, dataset, message):
    path = tmp_path / "data"
    path.write_text(content)
    # No server is needed: the dataset is read before the first request.
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", dataset, str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: error: ") and err.count("\n") == 1 and message in err


def test_unreachable_server_is_a_one_line_error(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert capsys.readouterr().err.startswith("tokenmill: error: cannot reach ")


def test_arrival_offsets_are_seeded_gamma_gaps():
    a = arrival_offsets(20_001, 4.0, 1.0, seed=7)
    assert a == arrival_offsets(20_001, 4.0, 1.0, seed=7)
    assert a != arrival_offsets(20_001, 4.0, 1.0, seed=8)
    assert a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(20_001, 4.0, 0.25, seed=7))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)  # CV 1/sqrt(shape)
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]


def test_error_text_takes_the_servers_message():
    body = json.dumps({"error": {"message": "prompt too long", "type": "invalid_request_error"}})
    assert error_text(400, body.encode()) == "HTTP 400: prompt too long"
    assert error_text(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    assert error_text(422, json.dumps({"detail": [{"msg": "x"}]}).encode()) == (
        'HTTP 422: [{"msg": "x"}]'
    )


def test_bench_serve_imports_no_torch_and_no_engine():
    import subprocess

    code = (
        "import sys; from tokenmill.cli import build_parser; build_parser(); "
        "import tokenmill.bench.serve, tokenmill.bench.report, tokenmill.bench.plot; "
        "print(sorted(m for m in ('torch', 'tokenmill.engine', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_gemma_server_with_its_tokenizer(tmp_path):
    """The embedded gemma-3-270m: exact token-length prompts by its tokenizer, chat and
    completions, counts equal to the server's."""
    from live_server import LiveServer

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine

    args = EngineArgs(model="gemma-3-270m", max_model_len=512, kv_cache_memory="64MiB")
    srv = LiveServer(lambda: AsyncEngine.from_args(args), served_model_name="gemma").start()
    try:
        for endpoint in ("completions", "chat"):
            before = scrape(srv.url)
            doc = _bench(srv.url, tmp_path, "--endpoint", endpoint, "--tokenizer", "gemma-3-270m",
                         "--num-prompts", "4", "--input-len", "64", "--output-len", "8")  # fmt: skip
            srv.wait_idle()
            after = scrape(srv.url)
            (run,) = doc["runs"]
            assert (run["model"], run["completed"], run["total_output_tokens"]) == ("gemma", 4, 32)
            assert _delta(before, after, GEN) == 32 + 2
            if endpoint == "completions":  # BOS + the 64 tokens drawn
                assert [r["prompt_len"] for r in run["requests"]] == [65] * 4
            assert run["ttft_ms"]["mean"] > 0 and run["tpot_ms"]["mean"] > 0
    finally:
        srv.stop()


def test_a_failing_test_request_stops_the_run_with_one_line(server, capsys):
    argv = ["bench", "serve", "--base-url", server.url, "--model", "no-such-model",
            "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"tokenmill: error: the test request to {server.url}/v1/completions failed: HTTP 404: "
    )
    assert "no-such-model" in err
