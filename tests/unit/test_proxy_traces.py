"""The proxy's per-request hand-off traces (``GET /proxy/traces``) and their join with the replay client's view
(``range_connector.bench.handoff``), over real HTTP with stub engines.

No speed is asserted: the slow prefill stub sleeps a known time, so its call lasts *at least* that long, and every
other check is about order, identity and arithmetic.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from range_connector.bench.handoff import HANDOFF_GOAL_S, fetch_traces, format_handoff, handoff_report, handoff_rows
from range_connector.bench.replay import ReplayRequest, RequestResult, replay_requests
from range_connector.serving.request_traces import MAX_REQUEST_ID_CHARS, TraceLog
from tests.unit.stub_engines import StubEngine, running_stacks

pytestmark = pytest.mark.timeout(60)

ORDER = ("received_s", "prefill_sent_s", "prefill_answered_s", "decode_sent_s", "decode_headers_s", "first_chunk_s",
         "done_s")
PREFILL_DELAY_S = 0.3


@pytest.fixture
def pd_stack():
    with running_stacks() as start:
        prefill = StubEngine("p0")
        prefill.behaviour.answer_delay_s = PREFILL_DELAY_S
        yield start([prefill], [StubEngine("d0")])


def _replay(base_url: str, num_requests: int) -> list[RequestResult]:
    requests = [ReplayRequest(i, 0.0, tuple(range(10 + i, 40 + i)), 3) for i in range(num_requests)]
    return asyncio.run(replay_requests(base_url, requests, progress=False, model="tiny-gqa"))


def test_each_request_leaves_a_trace_whose_stamps_follow_the_hand_off(pd_stack) -> None:
    results = _replay(pd_stack.proxy.base_url, 3)
    assert all(r.error is None for r in results), [r.error for r in results]
    traces = fetch_traces(pd_stack.proxy.base_url)
    assert traces is not None and len(traces) == 3
    by_id = {t["request_id"]: t for t in traces}
    for r in results:
        t = by_id[r.request_id]  # the client's X-Request-Id names the proxy's trace
        stamps = [t[k] for k in ORDER]
        assert all(isinstance(x, float) for x in stamps), t
        assert stamps == sorted(stamps), t
        assert t["prefill_answered_s"] - t["prefill_sent_s"] >= PREFILL_DELAY_S  # the stub slept that long
        assert (t["prefill_url"], t["decode_url"], t["status"]) == (pd_stack.prefills[0].url,
                                                                    pd_stack.decodes[0].url, 200)
    # the same request id went to both engines
    assert {h["X-Request-Id"] for h in pd_stack.prefills[0].headers} == {r.request_id for r in results}
    assert {h["X-Request-Id"] for h in pd_stack.decodes[0].headers} == {r.request_id for r in results}


def test_the_client_view_joins_the_traces_and_splits_ttft(pd_stack) -> None:
    results = _replay(pd_stack.proxy.base_url, 2)
    report = handoff_report(results, fetch_traces(pd_stack.proxy.base_url))
    assert report is not None and report["num_joined"] == 2
    for row in report["rows"]:
        assert row["prefill_s"] >= PREFILL_DELAY_S
        assert row["overhead_s"] == pytest.approx(row["ttft_s"] - row["prefill_s"] - row["decode_s"])
        parts = row["client_to_proxy_s"] + row["proxy_in_s"] + row["prefill_s"] + row["between_s"] \
            + row["decode_s"] + row["proxy_to_client_s"]
        assert parts == pytest.approx(row["ttft_s"])  # the six parts tile the client's TTFT
    assert report["goal_overhead_p50_s"] == HANDOFF_GOAL_S
    assert report["overhead_p50_ok"] == (report["stats_s"]["overhead_s"]["p50"] <= HANDOFF_GOAL_S)
    text = format_handoff(SimpleNamespace(label="range-pd", handoff=report))
    assert "range-pd: TTFT split from the proxy's traces (2 requests" in text and "outside both engines" in text


def test_a_hostile_request_id_is_cut_and_the_log_is_bounded() -> None:
    log = TraceLog(max_traces=4)
    for i in range(10):
        log.start(f"{i}-" + "x" * 100_000)
    kept = log.to_list()
    assert len(kept) == 4 and [t["request_id"][:2] for t in kept] == ["6-", "7-", "8-", "9-"]
    assert all(len(t["request_id"]) == MAX_REQUEST_ID_CHARS for t in kept)
    with pytest.raises(ValueError, match="max_traces"):
        TraceLog(max_traces=0)


def test_no_proxy_no_report_and_unjoinable_rows_are_left_out() -> None:
    assert handoff_report([], None) is None
    done = RequestResult(0, 0.0, ttft_s=0.5, request_id="a", sent_wall_s=100.0)
    failed = RequestResult(1, 0.0, ttft_s=None, request_id="b", sent_wall_s=100.0)
    trace: dict[str, Any] = {"request_id": "a", "received_s": 100.01, "prefill_sent_s": 100.02,
                             "prefill_answered_s": 100.3, "decode_sent_s": 100.31, "first_chunk_s": 100.49}
    broken = {"request_id": "b", "received_s": "soon"}
    [row] = handoff_rows([done, failed], [trace, broken])
    assert row["prefill_s"] == pytest.approx(0.28) and row["decode_s"] == pytest.approx(0.18)
    assert row["overhead_s"] == pytest.approx(0.04)
    fleet = {**trace, "prefill_sent_s": None, "prefill_answered_s": None}
    [row] = handoff_rows([done], [fleet])
    assert row["prefill_s"] == row["between_s"] == 0.0 and row["proxy_in_s"] == pytest.approx(0.30)
    assert fetch_traces("http://127.0.0.1:9") is None  # nothing listens there
