"""Debian's chromium, headless, driven by Playwright, for the pages' tests (/dashboard, /docs).

``requires_chromium`` skips a test only where chromium is absent and this is not CI; in CI
(CI=true; .ci/run installs chromium) a missing browser fails the test instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Without the background-networking flags chromium's own connections are refused on a closed
# network, and it may stall on them.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip

requires_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM) and not IN_CI,
    reason="chromium is not installed (apt-get install chromium chromium-driver; CI does)",
)


def artifacts_dir(tmp_path: Path) -> Path:
    """Where screenshots go: $TOKENMILL_TEST_ARTIFACTS, else the test's tmp_path."""
    path = Path(os.environ.get("TOKENMILL_TEST_ARTIFACTS") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def browser_context(tmp_path: Path) -> Iterator[Any]:
    """A Playwright browser context on a new, empty chromium profile."""
    if IN_CI:
        from playwright.sync_api import sync_playwright
    else:
        sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context
        finally:
            context.close()
