"""The replay client without an engine: timing of sends, failures recorded per request (never raised), summary
statistics, and the engine-histogram quantile rule."""

from __future__ import annotations

import asyncio
import math

import pytest

from range_connector.bench.replay import ReplayRequest, RequestResult, replay_requests, run_replay, summarize
from range_connector.bench.replay_metrics import histogram_quantile
from range_connector.testing.processes import free_port

pytestmark = pytest.mark.timeout(60)


def test_unreachable_endpoint_records_every_request_and_keeps_the_schedule() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    requests = [ReplayRequest(i, 0.1 * i, (5, 6, 7), 4) for i in range(5)]
    results = asyncio.run(replay_requests(url, requests, max_concurrency=2, request_timeout_s=5.0, progress=False))
    assert [r.index for r in results] == list(range(5))
    for req, res in zip(requests, results):
        assert res.error is not None and res.error.startswith("ConnectError"), res.error
        assert "\n" not in res.error
        assert res.ttft_s is None and res.output_tokens == 0
        assert res.sent_s is not None and res.sent_s >= req.arrival_s - 1e-3  # never early
        assert res.dispatch_delay_s is not None and res.dispatch_delay_s < 1.0
    summary = summarize(results)
    assert summary["num_ok"] == 0 and summary["num_errors"] == 5 and summary["errors"] == {"ConnectError": 5}
    assert summary["ttft_s"]["p50"] is None


def test_run_replay_refuses_a_warmup_that_leaves_nothing() -> None:
    with pytest.raises(ValueError, match="warmup: 2 must be >= 0 and < the 2 requests"):
        run_replay("http://127.0.0.1:1", [ReplayRequest(0, 0.0, (1,), 1)] * 2, warmup=2)
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(replay_requests("http://127.0.0.1:1", [], max_concurrency=0))


def test_summary_percentiles_and_throughput() -> None:
    results = [RequestResult(i, float(i), sent_s=float(i), dispatch_delay_s=0.0, ttft_s=0.1 * (i + 1),
                             e2e_s=1.0, prompt_tokens=100, output_tokens=10) for i in range(10)]
    results.append(RequestResult(10, 10.0, sent_s=10.0, e2e_s=0.5, prompt_tokens=100, error="HTTP 500: boom"))
    s = summarize(results)
    assert s["num_ok"] == 10 and s["errors"] == {"HTTP 500": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)  # numpy linear interpolation of 0.1..1.0
    assert s["ttft_s"]["p90"] == pytest.approx(0.91)
    assert s["ttft_s"]["mean"] == pytest.approx(0.55)
    assert s["span_s"] == pytest.approx(10.5)  # first send 0 s, last end 10 + 0.5 s
    assert s["request_throughput_per_s"] == pytest.approx(10 / 10.5)
    assert s["output_tokens_per_s"] == pytest.approx(100 / 10.5)
    assert s["total_tokens_per_s"] == pytest.approx(1100 / 10.5)


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 10 observations: 4 <= 0.1 s, 4 more <= 0.5 s, 2 more <= 1 s.
    buckets = {0.1: 4.0, 0.5: 8.0, 1.0: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 4) / 4)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * (9 - 8) / 2)
    assert histogram_quantile(0.99, {0.1: 0.0, 1.0: 1.0, math.inf: 3.0}) == 1.0  # in +Inf: the largest bound
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None


def test_comparison_table_ratios_and_output_equality(tmp_path) -> None:
    import json

    from range_connector.bench.replay import ReplayReport
    from range_connector.bench.replay_report import (
        format_comparison,
        output_divergences,
        ratios,
        same_outputs,
        write_json,
    )

    def report(label: str, ttft_s: float, digests: list[str]) -> ReplayReport:
        ids = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 9, 9, 9], "x": [9, 9, 5, 5]}
        results = [RequestResult(i, float(i), sent_s=float(i), dispatch_delay_s=0.0, ttft_s=ttft_s, e2e_s=2 * ttft_s,
                                 prompt_tokens=10, output_tokens=4, output_digest=d, output_token_ids=ids[d])
                   for i, d in enumerate(digests)]
        return ReplayReport(label, None, {}, summarize(results), None, results)

    none = report("none", 0.4, ["a", "b", "c"])
    rng = report("range", 0.1, ["a", "b", "x"])
    assert output_divergences(rng, none) == {2: 2} and output_divergences(none, none) == {}
    assert same_outputs(rng, none) == (2, 3) and same_outputs(none, none) == (3, 3)
    assert ratios([none, rng])["range"]["TTFT p50 (s)"] == pytest.approx(0.25)
    table = format_comparison([none, rng])
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "none", "range", "range/none"]
    assert any(line.startswith("outputs equal to none") and "2 / 3" in line for line in lines)
    assert any(line.startswith("TTFT p50 (s)") and line.rstrip().endswith("0.25x") for line in lines)
    doc = json.loads(write_json(tmp_path / "r.json", [none, rng]).read_text())
    assert any(line.startswith("  differ from output token #") and line.split()[-1] == "2" for line in lines)
    assert doc["outputs_equal_to_none"]["range"] == {"equal": 2, "compared": 3, "first_differing_token": {"2": 2}}
    assert doc["ratios_vs_none"]["range"]["E2E p50 (s)"] == pytest.approx(0.25)
    # a report measured against another baseline (the demo's fleet) is left out of none's ratios
    fleet = report("prefix-range", 0.2, ["a", "b", "c"])
    doc = json.loads(write_json(tmp_path / "r2.json", [none, rng, fleet], compared=["range"]).read_text())
    assert set(doc["ratios_vs_none"]) == {"range"} and len(doc["reports"]) == 3


def test_unreadable_metrics_are_reported_not_raised() -> None:
    from range_connector.bench.replay_metrics import engine_counts, snapshot_metrics

    url = f"http://127.0.0.1:{free_port()}"  # an engine that is gone
    snap = snapshot_metrics([url], timeout_s=2.0)
    assert list(snap.errors) == [url] and snap.errors[url].startswith("ConnectError") and not snap.counters
    counts = engine_counts(snap, snap)
    assert counts.totals["external_hit_tokens"] == 0 and counts.external_hit_share is None
    assert counts.to_dict()["unreadable_engines"] == {url: snap.errors[url]}
