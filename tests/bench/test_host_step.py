"""benchmarks/host_step.py end to end at a small size, in gemma-3's KV layout and Llama's (the
latter with a cache flush in the forward's place): every part reports a figure, and with
--phases the engine step's host share is split into its phases."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "host_step.py"


@pytest.mark.parametrize(
    ("layout", "groups", "forward"), [("gemma-3", 6, "cpu"), ("llama", 1, "flush")]
)
def test_four_requests_report_each_part_and_the_phases_of_a_step(layout, groups, forward) -> None:
    cmd = [sys.executable, str(SCRIPT), "--requests", "4", "--steps", "120", "--kinds", "delta",
           "--phases", "--layout", layout, "--forward", forward]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    assert f"{layout}'s KV layout ({groups} groups)" in out
    assert float(re.search(r"schedule \+ update_from_output: (\d+\.\d+)", out).group(1)) > 0
    found = re.search(r"host share .*: (\d+\.\d+) of (\d+\.\d+); the core's step: (\d+\.\d+)", out)
    host, whole, core = map(float, found.groups())
    assert 0 < host < whole  # the forward is timed apart
    assert 0 < core < host  # the output side is not the core's
    phases = dict(re.findall(r"([a-z_:]+(?: [a-z]+)?) (-?\d+\.\d+)", out.splitlines()[-1]))
    assert list(phases) == [
        "schedule", "runner inputs", "sampling", "update_from_output", "outputs: process",
        "outputs: collect", "rest",
    ]  # fmt: skip
    assert all(float(ms) >= 0 for name, ms in phases.items() if name != "rest")
    assert float(phases["runner inputs"]) < host  # its forward is not counted in it
