"""benchmarks/server_host.py end to end at a small size: the server in its child process takes
the streams, every token of every stream comes back (in as many chunks or fewer), and the
figures are read off the server's own step times."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "server_host.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_four_streams_report_the_servers_step_beside_the_engines() -> None:
    cmd = [sys.executable, str(SCRIPT), "--requests", "4", "--tokens", "50",
           "--port", str(free_port())]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    tokens, chunks = map(int, re.search(r"\((\d+) tokens in (\d+) chunks", out).groups())
    assert tokens == 4 * 50 and 0 < chunks <= tokens
    figures = re.findall(r"(start to start|step itself|engine alone).*?:\s+(\d+\.\d+)$", out, re.M)
    assert [name for name, _ in figures] == ["start to start", "step itself", "engine alone"]
    assert all(float(ms) > 0 for _, ms in figures)
