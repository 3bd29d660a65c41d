"""The demo's parts that need no engine: its traces, the decode engine's view of P/D counts, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from range_connector.bench.demo import decode_engine_view, load_trace, main
from range_connector.bench.replay_metrics import COUNTERS, EngineCounts
from range_connector.bench.synthetic_trace import synthetic_trace
from range_connector.bench.traces import write_mooncake

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.timeout(30)
def test_default_trace_is_the_scaled_synthetic_one() -> None:
    trace = load_trace(None, count=None, token_scale=None, duration_s=90.0)
    assert len(trace.requests) == 40 and trace.format == "synthetic"
    assert trace.block_tokens == 32  # 512 x 1/16
    assert any("tokens x 0.0625" in note for note in trace.transforms)
    assert max(r.input_tokens for r in trace.requests) <= 4096


@pytest.mark.timeout(60)
def test_a_trace_file_is_sampled_by_conversation_and_compressed_to_the_duration(tmp_path: Path) -> None:
    source = synthetic_trace(300, seed=3, request_rate_per_s=0.01)  # ~8 hours of arrivals
    path = tmp_path / "trace.jsonl"
    write_mooncake(source, path)
    trace = load_trace(str(path), count=50, token_scale=None, duration_s=60.0)
    assert len(trace.requests) == 50
    assert trace.requests[-1].arrival_s == pytest.approx(60.0)
    assert trace.block_tokens == 16  # 512 x 1/32
    notes = " | ".join(trace.transforms)
    assert "conversations: 50 requests" in notes and "time x " in notes and "tokens x 0.03125" in notes


@pytest.mark.timeout(60)
@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"the public Mooncake trace is not at {MOONCAKE}")
def test_the_mooncake_sample_shares_prefixes() -> None:
    trace = load_trace(str(MOONCAKE), count=None, token_scale=None, duration_s=90.0)
    info = trace.describe()
    assert info["num_requests"] == 100 and info["duration_s"] == pytest.approx(90.0)
    assert info["best_prefix_hit_share"] > 0.3  # a contiguous slice shares almost nothing


@pytest.mark.timeout(30)
def test_bad_duration_is_named() -> None:
    from range_connector.errors import TraceError

    with pytest.raises(TraceError, match="--duration-s"):
        load_trace(None, count=None, token_scale=None, duration_s=0.0)


def _counts(prompt: float, local: float, external: float, ttft_sum_s: float, ttft_count: float) -> dict[str, float]:
    counts = dict.fromkeys(COUNTERS, 0.0)
    counts.update(prompt_tokens=prompt, local_hit_tokens=local, external_hit_tokens=external,
                  engine_ttft_sum_s=ttft_sum_s, engine_ttft_count=ttft_count)
    return counts


@pytest.mark.timeout(30)
def test_decode_engine_view_takes_the_decode_engines_counts() -> None:
    prefill, decode = "http://127.0.0.1:1", "http://127.0.0.1:2"
    per_engine = {prefill: _counts(1000, 400, 0, 8.0, 10), decode: _counts(1000, 100, 850, 2.0, 10)}
    totals = {key: per_engine[prefill][key] + per_engine[decode][key] for key in COUNTERS}
    both = EngineCounts(totals=totals, per_engine=per_engine, prompt_by_source={},
                        engine_ttft_s={"count": 20, "mean": 0.5, "p50": 0.4, "p90": 0.9, "p99": 1.0},
                        external_hit_share=850 / 2000, local_hit_share=500 / 2000,
                        extra={"span_s": 1.0, "served_by_tier_share": {"valkey": 850 / 2000},
                               "tier_tokens_per_engine": {decode: {"valkey": 850.0}}})
    view = decode_engine_view(both, decode)
    assert view.extra["served_by_tier_share"] == {"valkey": pytest.approx(0.85)}, "the decode engine's share"
    assert view.external_hit_share == pytest.approx(0.85) and view.local_hit_share == pytest.approx(0.10)
    assert view.prompt_tokens == 1000 and view.external_hit_tokens == 850
    assert view.engine_ttft_s["mean"] == pytest.approx(0.2) and view.engine_ttft_s["p99"] is None
    assert view.extra["both_engines"]["totals"]["prompt_tokens"] == 2000
    assert decode_engine_view(both, "http://127.0.0.1:3") is both  # decode engine unreadable: unchanged
    assert decode_engine_view(None, decode) is None


@pytest.mark.timeout(30)
def test_decode_engine_view_keeps_the_decode_engines_histogram_and_connector_check() -> None:
    prefill, decode = "http://127.0.0.1:1", "http://127.0.0.1:2"
    per_engine = {prefill: _counts(1000, 400, 0, 8.0, 10), decode: _counts(1000, 100, 850, 2.0, 10)}
    per_engine[decode].update(range_loaded_tokens=800, range_failed_tokens=50)
    totals = {key: per_engine[prefill][key] + per_engine[decode][key] for key in COUNTERS}
    own = {prefill: {"count": 10, "mean": 0.8, "p50": 0.7, "p90": 1.0, "p99": 1.2},
           decode: {"count": 10, "mean": 0.2, "p50": 0.15, "p90": 0.3, "p99": 0.4}}
    both = EngineCounts(totals=totals, per_engine=per_engine, prompt_by_source={},
                        engine_ttft_s={"count": 20, "mean": 0.5, "p50": 0.4, "p90": 0.9, "p99": 1.0},
                        external_hit_share=850 / 2000, local_hit_share=500 / 2000,
                        extra={"span_s": 1.0, "per_engine_ttft_s": own}, range_engines=(prefill, decode))
    view = decode_engine_view(both, decode)
    assert view.engine_ttft_s == own[decode]
    assert view.connector_check["loaded_tokens"] == 800 and view.connector_check["agrees"]
    assert view.served_from_tier_share == pytest.approx(0.80)


@pytest.mark.timeout(30)
def test_an_unreadable_trace_fails_in_one_line_before_starting_anything(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jsonl"
    assert main(["--trace", str(missing), "--demo-dir", str(tmp_path / "demo")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("FAILED: ") and "--trace" in out[0] and str(missing) in out[0]
    assert not (tmp_path / "demo" / "run" / "valkey").exists()
