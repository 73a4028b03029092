"""Fuzzing: schemathesis against the server's own /openapi.json, every operation, valid and
invalid bodies, parameters and methods (its coverage and fuzzing phases, mode "all"). Checks on
every answer: never a 5xx, the status code documented, the content type documented, the body
valid against the documented schema. The 5xx count is also read from schemathesis' NDJSON
report, every response it recorded, so a crash the checks miss still counts.

Quick (default run): 30 cases per operation on the tiny random-weight Llama, under a minute
on 2 cores (the server caps max_tokens at 4, so the many valid requests are quick; the
documented examples, streamed, are among them). Soak (``pytest -m soak tests/reliability``):
1000 per operation.
``run_fuzz`` is also what benchmarks/reliability_report.py runs.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from browser import IN_CI  # noqa: E402
from live_server import running_server  # noqa: E402

KEY, ADMIN = "sk-fuzz", "sk-fuzz-admin"
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)
QUICK_EXAMPLES = 30
SOAK_EXAMPLES = 1000


@dataclass
class FuzzRun:
    """What one schemathesis run did: its exit code and summary, the cases it generated, the
    operations it tested, the answers by (operation, status), and every recorded answer that
    was a 5xx (method, URL, status, body)."""

    returncode: int
    output: str
    num_cases: int
    num_operations: int
    num_responses: int
    server_errors: list[tuple[str, str, int, str]] = field(default_factory=list)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)


def run_fuzz(
    url: str,
    key: str,
    max_examples: int,
    workdir: Path,
    timeout: float = 600,
    paths: str | None = None,
) -> FuzzRun:
    """schemathesis (its ``st`` CLI beside this Python) on ``url``/openapi.json with ``key``;
    ``paths``: only the operations whose path matches this regex."""
    st = Path(sys.executable).parent / "st"
    report = workdir / "report"
    only = ["--include-path-regex", paths] if paths else []
    result = subprocess.run(
        [str(st), "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {key}",
         "-n", str(max_examples), "--phases", "examples,coverage,fuzzing", "-c", ",".join(CHECKS),
         "--mode", "all", "--generation-deterministic", "--request-timeout", "30",
         "--no-color", "--report", "ndjson", "--report-dir", str(report), *only],
        capture_output=True, text=True, timeout=timeout, cwd=workdir,  # its files go there
    )  # fmt: skip
    output = result.stdout + result.stderr
    cases = re.search(r"(\d+) generated", output)
    tested = re.search(r"Tested:\s*(\d+)", output)
    num_responses, errors, statuses = 0, [], Counter()
    for path in sorted(report.glob("*.ndjson")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            finished = event.get("ScenarioFinished")
            if finished is None:
                continue
            for interaction in finished["recorder"].get("interactions", {}).values():
                response = interaction.get("response")
                if response is None:
                    continue
                num_responses += 1
                statuses[(finished["recorder"]["label"], response["status_code"])] += 1
                if response["status_code"] >= 500:
                    request = interaction["request"]
                    errors.append(
                        (request["method"], request["uri"], response["status_code"],
                         _body_text(response.get("content")))
                    )  # fmt: skip
    return FuzzRun(
        result.returncode,
        output,
        int(cases.group(1)) if cases else 0,
        int(tested.group(1)) if tested else 0,
        num_responses,
        errors,
        statuses,
    )


def _body_text(content: object) -> str:
    if isinstance(content, dict) and "$base64" in content:
        return base64.b64decode(content["$base64"]).decode(errors="replace")[:500]
    return str(content)[:500]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    if not IN_CI:
        pytest.importorskip("schemathesis")
    # Small caps on max_tokens and n: a valid request is generated in a few steps, so the
    # cases that reach the engine (the documented examples and many fuzzed ones) stay quick.
    with running_server(
        tiny_model_dir("llama"), api_keys=(KEY,), admin_api_key=ADMIN, max_tokens=4, max_n=2
    ) as srv:
        yield srv


def _check(server, run: FuzzRun) -> None:
    assert run.server_errors == [], run.server_errors[:5]
    assert run.returncode == 0, run.output[-6000:]
    # Every operation of the app was loaded and tested (schemathesis leaves out the document's
    # own route, GET /openapi.json: tests/server/test_openapi.py reads it), and the run did work.
    lines = {
        k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in run.output.splitlines())
    }
    selected, total = lines["Selected"].split("/")
    num_operations = sum(len(item) for item in server.app.openapi_schema["paths"].values()) - 1
    assert selected == total == str(run.num_operations) == str(num_operations), run.output[-2000:]
    assert run.num_cases >= 20 * num_operations and run.num_responses >= run.num_cases
    # Valid requests reached the engine (the documented examples, streamed, among them).
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /api/generate"):
        assert run.statuses[(label, 200)] >= 5, (label, run.statuses)
    server.wait_idle(timeout=60)


def test_fuzzed_requests_get_no_server_error_and_match_the_schema(server, tmp_path) -> None:
    _check(server, run_fuzz(server.url, ADMIN, QUICK_EXAMPLES, tmp_path))


@pytest.mark.soak
def test_soak_fuzz_every_operation(server, tmp_path) -> None:
    _check(server, run_fuzz(server.url, ADMIN, SOAK_EXAMPLES, tmp_path, timeout=3600))


def test_fuzzed_embedding_requests_on_an_embedding_model(embedding_model_dir, tmp_path) -> None:
    """The embedding routes where they run: an embedding checkpoint (mean pooling, normalized)
    answers fuzzed inputs, token ids and dimensions with 200s and 4xx, never a 5xx."""
    if not IN_CI:
        pytest.importorskip("schemathesis")
    with running_server(embedding_model_dir("mean"), {"max_model_len": 64}, api_keys=(KEY,)) as srv:
        run = run_fuzz(srv.url, KEY, QUICK_EXAMPLES, tmp_path, paths="embed")
        srv.wait_idle(timeout=60)
    assert run.server_errors == [], run.server_errors[:5]
    assert run.returncode == 0, run.output[-6000:]
    for label in ("POST /v1/embeddings", "POST /api/embed", "POST /api/embeddings"):
        assert run.statuses[(label, 200)] >= 3, (label, run.statuses)
