"""Paired, alternated replay rounds (``bench/replay.py --pairs``): the order of each round, the ratios taken within a
round, and Range's hook time read from an engine's ``/metrics`` (``vllm:range_hook_seconds_total``)."""

from __future__ import annotations

import pytest

from range_connector.bench.paired import format_paired, hook_shares, paired_doc, paired_ratios, round_order
from range_connector.bench.replay import ReplayReport, RequestResult, summarize
from range_connector.bench.replay_metrics import MetricsSnapshot, engine_counts

pytestmark = pytest.mark.timeout(60)


def report(label: str, ttft_s: float, tpot_s: float, hook_s: dict[str, float] | None = None) -> ReplayReport:
    results = [RequestResult(i, float(i), sent_s=float(i), dispatch_delay_s=0.0, ttft_s=ttft_s, tpot_s=tpot_s,
                             e2e_s=ttft_s + 3 * tpot_s, prompt_tokens=10, output_tokens=4)
               for i in range(3)]
    engine = None
    if hook_s is not None:
        def snap(seconds: dict[str, float], at_s: float) -> MetricsSnapshot:
            return MetricsSnapshot({"u": {"vllm:prompt_tokens_total": 30.0 * at_s}}, {"u": {}}, {"u": {}}, at_s,
                                   hook_seconds={"u": seconds})
        engine = engine_counts(snap({h: 1.0 for h in hook_s}, 10.0),
                               snap({h: 1.0 + s for h, s in hook_s.items()}, 20.0))
    return ReplayReport(label, None, {}, summarize(results), engine, results)


def test_rounds_alternate_their_order() -> None:
    assert round_order(["none", "range", "lmcache"], 0) == ["none", "range", "lmcache"]
    assert round_order(["none", "range", "lmcache"], 1) == ["lmcache", "range", "none"]
    assert round_order(["none", "range"], 2) == ["none", "range"]


def test_each_configuration_is_divided_by_the_baseline_of_its_own_round() -> None:
    rounds = [[report("none", 1.0, 0.10), report("range", 1.1, 0.10)],
              [report("none", 2.0, 0.20), report("range", 2.0, 0.22)],  # a slower round: both sides slower
              [report("none", 1.0, 0.10)]]  # a round whose range run is missing
    ratios = paired_ratios(rounds, "none")
    assert list(ratios) == ["range"]
    assert ratios["range"]["TTFT p50"] == pytest.approx([1.1, 1.0, None])
    assert ratios["range"]["TPOT p50"][:2] == pytest.approx([1.0, 1.1])
    text = format_paired(rounds, "none")
    assert "median 1.050 [1.000..1.100]" in text  # TTFT p50: median of the two pairs, not of the raw seconds


def test_hook_seconds_come_from_the_engine_metrics_delta_over_the_span() -> None:
    rng = report("range", 1.0, 0.1, hook_s={"wait_for_save": 0.5, "get_num_new_matched_tokens": 0.1})
    assert rng.engine is not None and rng.engine.extra["range_hook_s"] == {
        "wait_for_save": pytest.approx(0.5), "get_num_new_matched_tokens": pytest.approx(0.1)}
    assert hook_shares(rng) == {"wait_for_save": pytest.approx(0.05), "get_num_new_matched_tokens": pytest.approx(0.01)}
    assert hook_shares(report("none", 1.0, 0.1)) == {}
    rounds = [[report("none", 1.0, 0.1), rng]]
    assert "Range's hooks took 6.00% of the replay's span" in format_paired(rounds, "none")
    assert paired_doc(rounds, "none")["hook_shares"][0][1]["shares"]["wait_for_save"] == pytest.approx(0.05)


def test_the_connector_times_each_hook_under_its_own_name() -> None:
    """The decorator adds the time spent inside a hook to the stats key vLLM's stats carry to ``/metrics``."""
    from range_connector.connector import _timed
    from range_connector.metrics import HOOKS, hook_key

    class Fake:
        def __init__(self) -> None:
            self._hook_s: dict[str, float] = {}

        @_timed
        def wait_for_save(self) -> int:
            return 7

        @_timed
        def start_load_kv(self) -> None:
            raise RuntimeError("boom")

    fake = Fake()
    assert fake.wait_for_save() == 7 and fake.wait_for_save() == 7
    with pytest.raises(RuntimeError):
        fake.start_load_kv()
    assert set(fake._hook_s) == {hook_key("wait_for_save"), hook_key("start_load_kv")}
    assert all(v >= 0.0 for v in fake._hook_s.values()) and "wait_for_save" in HOOKS
