"""GET /dashboard in a real headless browser (Debian's chromium driven by Playwright): the page
asks for the key, keeps it in the session, and charts nonzero figures from /v1/stats while a
load runs; a screenshot is kept ($TOKENMILL_TEST_ARTIFACTS, else the test's tmp_path).

Skipped only where chromium is absent and this is not CI (CI installs it: .ci/run)."""

from __future__ import annotations

import threading
import time

import httpx
from browser import artifacts_dir, browser_context, requires_chromium
from live_server import MODEL_NAME, running_server

from tokenmill.cost import TokenPrices

KEY = "sk-dashboard"
pytestmark = requires_chromium


class Load:
    """Streamed completions from a few threads until stopped."""

    def __init__(self, url: str, num_threads: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.num_done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(num_threads)]

    def _run(self, idx: int) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=self.url, timeout=60, headers=headers) as client:
            while not self.stop.is_set():
                body = {"model": MODEL_NAME, "prompt": f"load {idx} {self.num_done}",
                        "max_tokens": 48, "ignore_eos": True, "stream": True}  # fmt: skip
                with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        self.errors.append(r.read().decode())
                        return
                    for _ in r.iter_lines():
                        pass
                self.num_done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_dashboard_charts_a_live_load(tiny_model_dir, tmp_path) -> None:
    with (
        running_server(
            tiny_model_dir("llama"),
            api_keys=(KEY,),
            price_per_hour=2.5,
            prices=TokenPrices(input_per_million=0.1, output_per_million=0.4),
            stats_window=10.0,
        ) as server,
        browser_context(tmp_path) as browser,
    ):
        page = browser.new_page()
        page.goto(f"{server.url}/dashboard?interval_ms=250")
        # No key yet: the stats route answered 401, so the page asks for one.
        page.wait_for_selector("#key-form.shown", timeout=10_000)
        page.fill("#api-key", "wrong-key")
        page.click("#save-key")
        page.wait_for_function(
            "document.getElementById('key-error').textContent.includes('refused')",
            timeout=10_000,
        )
        page.fill("#api-key", KEY)
        page.click("#save-key")
        with Load(server.url) as load:
            page.wait_for_function(
                "() => { const s = window.tokenmillDashboard.last;"
                " return s && s.generation_tokens_per_s > 0 && s.num_requests_running > 0"
                " && s.ttft_s.count > 0 && s.itl_s.count > 0; }",
                timeout=30_000,
            )
            time.sleep(1.5)  # a few more polls, so the lines have length
            charts = page.evaluate(_READ_CHARTS)
            shot = artifacts_dir(tmp_path) / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        assert not load.errors and load.num_done > 0
        assert shot.stat().st_size > 10_000
        for name in ("throughput", "requests", "ttft", "itl", "cost"):
            chart = charts[name]
            assert chart["points"] >= 3, (name, chart)
            assert chart["max"] > 0, (name, chart)
            # The first series' colour is on the canvas: a line was drawn.
            assert chart["first_series_pixels"] > 20, (name, chart)
        tiles = page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('.tile')].map("
            "t => [t.children[0].textContent, t.children[1].textContent]))"
        )
        assert float(tiles["generation tok/s"]) > 0
        assert page.text_content("#model") == MODEL_NAME
        assert page.text_content("#status") == "ready"
        # The key stays for the session: a reload goes straight to the charts.
        assert page.evaluate("sessionStorage.getItem('tokenmill.apiKey')") == KEY
        page.reload()
        page.wait_for_function("window.tokenmillDashboard.polls >= 2", timeout=10_000)
        assert not page.is_visible("#key-form")


# Per chart: points drawn, the largest value, and how many pixels have the first series'
# colour (#4cc2ff; antialiasing aside, a drawn line has many).
_READ_CHARTS = """() => {
  const out = {};
  for (const canvas of document.querySelectorAll('canvas')) {
    const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let hits = 0;
    for (let i = 0; i < data.length; i += 4) {
      if (Math.abs(data[i] - 0x4c) < 8 && Math.abs(data[i + 1] - 0xc2) < 8
          && Math.abs(data[i + 2] - 0xff) < 8 && data[i + 3] > 200) hits++;
    }
    out[canvas.id.replace('chart-', '')] = {
      points: Number(canvas.dataset.points), max: Number(canvas.dataset.max),
      first_series_pixels: hits,
    };
  }
  return out;
}"""
