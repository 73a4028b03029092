"""Serving metrics on synthetic timestamps, with the values worked out by hand."""

from __future__ import annotations

import pytest

from tokenmill.bench.metrics import (
    RequestResult,
    calculate_metrics,
    parse_goodput,
    tokens_per_second_timeline,
)
from tokenmill.cost import cost_per_million_tokens


def _ok(chunks: list[float], output_len: int, prompt_len: int = 10, start: float = 0.0):
    return RequestResult(
        success=True, prompt_len=prompt_len, output_len=output_len, start_time=start,
        chunk_times=chunks,
    )  # fmt: skip


# Request A: TTFT 0.1, chunks at 0.1, 0.3, 0.6 (gaps 0.2, 0.3), 3 tokens: TPOT (0.6-0.1)/2 = 0.25
# Request B: TTFT 0.2, chunks at 0.2, 0.3 (gap 0.1), 5 tokens (several a chunk): TPOT 0.1/4 = 0.025
# Request C: TTFT 0.4, one token: no TPOT, no ITL.
# Request D: failed.
A = _ok([0.1, 0.3, 0.6], 3, prompt_len=10)
B = _ok([0.2, 0.3], 5, prompt_len=20, start=0.5)
C = _ok([0.4], 1, prompt_len=30, start=1.0)
D = RequestResult(success=False, prompt_len=99, error="HTTP 400: too long")


def test_tpot_itl_e2el_and_throughput():
    m = calculate_metrics([A, B, C, D], duration_s=2.0)
    assert (m.num_requests, m.completed, m.failed) == (4, 3, 1)
    assert m.errors == {"HTTP 400: too long": 1}
    # Failed requests count no tokens and enter no latency.
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 9)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 4.5
    assert m.total_token_throughput == 34.5
    assert m.ttft_ms.mean == pytest.approx(700 / 3)
    assert m.ttft_ms.median == pytest.approx(200)
    # TPOT only for requests with > 1 token: [250, 25] ms.
    assert m.tpot_ms.mean == pytest.approx(137.5)
    assert m.tpot_ms.median == pytest.approx(137.5)
    # ITL pooled over requests: [200, 300, 100] ms.
    assert m.itl_ms.mean == pytest.approx(200)
    assert m.itl_ms.median == pytest.approx(200)
    assert m.itl_ms.std == pytest.approx((20000 / 3) ** 0.5)
    # E2EL at the last content chunk: [600, 300, 400] ms.
    assert m.e2el_ms.mean == pytest.approx(1300 / 3)
    assert m.per_user_output_throughput == pytest.approx(1000 / 137.5)
    assert m.request_goodput is None


def test_percentiles_are_numpys_linear_interpolation():
    # TTFTs 0.1 .. 1.0 s: p90 = 0.1 + 0.9 * 9 * 0.1 = 0.91 s, p99 = 0.991 s, p50 = 0.55 s.
    results = [_ok([0.1 * i], 1) for i in range(1, 11)]
    d = calculate_metrics(results, 1.0).ttft_ms
    assert d.percentiles == pytest.approx({"p50": 550.0, "p90": 910.0, "p99": 991.0})
    assert d.median == pytest.approx(550.0)


def test_goodput_counts_requests_meeting_every_slo():
    # TTFTs 100, 200, 400 ms; TPOTs 250, 25, (one token: 0) ms; E2ELs 600, 300, 400 ms.
    def goodput(*slos: str) -> float:
        return calculate_metrics([A, B, C, D], 2.0, parse_goodput(slos)).request_goodput

    assert goodput("ttft:200") == 1.0  # A and B (an SLO met exactly counts)
    assert goodput("tpot:100") == 1.0  # B and C (C's single token: TPOT 0)
    assert goodput("ttft:200", "tpot:100") == 0.5  # B only
    assert goodput("e2el:450") == 1.0  # B and C
    assert goodput("ttft:50") == 0.0


def test_parse_goodput_refuses_bad_slos():
    assert parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    for bad in ("ttft", "latency:5", "tpot:fast", "ttft:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


def test_no_completed_request_reads_as_zeros():
    m = calculate_metrics([D], 1.0)
    assert (m.completed, m.failed, m.output_throughput) == (0, 1, 0.0)
    assert m.ttft_ms.mean == m.tpot_ms.percentiles["p99"] == 0.0
    assert m.per_user_output_throughput == 0.0
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics([A], 0.0)


def test_cost_per_million_tokens_of_a_run():
    m = calculate_metrics([A, B, C], 2.0)
    # 4.5 output tokens/s = 16,200 an hour; at $3.24/h: $200 per million.
    assert cost_per_million_tokens(3.24, m.output_throughput) == pytest.approx(200.0)
    assert cost_per_million_tokens(3.24, 0.0) is None


def test_tokens_per_second_timeline():
    # A's 3 tokens at 0.1, 0.3, 0.6; B's 5 over chunks at 0.7, 0.8 (2.5 each); C's 1 at 1.4.
    times, rates = tokens_per_second_timeline([A, B, C, D], bin_s=0.5)
    assert times == [0.0, 0.5, 1.0]
    assert rates == pytest.approx([4.0, 12.0, 2.0])  # (2, 1 + 5, 1) tokens per 0.5 s
