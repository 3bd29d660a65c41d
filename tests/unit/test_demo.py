"""The demo's parts that need no engine: its traces, the decode engine's view of P/D counts, bad input, and, with
the engine phases faked, its tables, verdicts, fleet phase and exit status."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from range_connector.bench import demo
from range_connector.bench.demo import decode_engine_view, load_trace, main
from range_connector.bench.replay import ReplayReport
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


# ------------------------------------------------------------------ tables, verdicts and the fleet phase (faked runs)
PREFILL, DECODE = "http://127.0.0.1:1", "http://127.0.0.1:2"
ENGINE_A, ENGINE_B = "http://127.0.0.1:3", "http://127.0.0.1:4"


def _report(label: str, ttft_p50_s: float | None, ttft_p99_s: float | None, *, num_errors: int = 0,
            engine: EngineCounts | None = None) -> ReplayReport:
    """A replay's report as :func:`range_connector.bench.replay.run_replay` would give it, with the TTFTs given."""
    ttft_s = {"count": 40, "mean": ttft_p50_s, "p50": ttft_p50_s, "p90": ttft_p99_s, "p99": ttft_p99_s}
    summary = {"num_requests": 40, "num_ok": 40 - num_errors, "num_errors": num_errors,
               "errors": {"HTTP 500": num_errors} if num_errors else {}, "ttft_s": ttft_s}
    return ReplayReport(label=label, trace=None, options={}, summary=summary, engine=engine)


def _engines(per_engine: dict[str, dict[str, float]], *, with_range: bool) -> EngineCounts:
    totals = {key: sum(counts[key] for counts in per_engine.values()) for key in COUNTERS}
    prompt = totals["prompt_tokens"]
    return EngineCounts(totals=totals, per_engine=per_engine, prompt_by_source={}, engine_ttft_s={},
                        external_hit_share=totals["external_hit_tokens"] / prompt,
                        local_hit_share=totals["local_hit_tokens"] / prompt,
                        range_engines=tuple(per_engine) if with_range else ())


def _pd_report(loaded_tokens: float = 800) -> ReplayReport:
    decode = _counts(1000, 100, loaded_tokens, 2.0, 10)
    decode.update(range_loaded_tokens=loaded_tokens)
    return _report("range-pd", 0.6, 3.0, engine=_engines({PREFILL: _counts(1000, 400, 0, 8.0, 10), DECODE: decode},
                                                         with_range=True))


def _fleet_reports(*, range_errors: int = 0) -> list[ReplayReport]:
    ranged = _counts(2000, 1200, 300, 4.0, 20)
    ranged.update(range_loaded_tokens=300)
    return [_report("prefix-none", 0.25, 0.8, engine=_engines({ENGINE_A: _counts(16000, 11000, 0, 4.0, 30),
                                                               ENGINE_B: _counts(3000, 1500, 0, 1.0, 10)},
                                                              with_range=False)),
            _report("prefix-range", 0.2, 1.2, num_errors=range_errors,
                    engine=_engines({ENGINE_A: _counts(17000, 12000, 0, 4.0, 30), ENGINE_B: ranged},
                                    with_range=True))]


@pytest.mark.timeout(30)
def test_the_verdict_says_faster_or_slower_per_quantile_from_the_reports() -> None:
    none, pd = _report("none", 0.2, 2.0), _report("range-pd", 0.5, 1.0)
    verdict = demo.ttft_verdict(pd, none)
    assert verdict.startswith("verdict, range-pd against none (one engine without a connector): Range is ")
    assert "slower at TTFT p50 (0.500 s against 0.200 s, 2.50x)" in verdict
    assert "faster at TTFT p99 (1.000 s against 2.000 s, 0.50x)" in verdict
    swapped = demo.ttft_verdict(_report("prefix-range", 0.1, 3.0), _report("prefix-none", 0.2, 2.0))
    assert "faster at TTFT p50" in swapped and "slower at TTFT p99" in swapped and "prefix-aware proxy" in swapped
    assert "as fast at TTFT p50" in demo.ttft_verdict(_report("range-pd", 0.2, 1.0), none)


@pytest.mark.timeout(30)
def test_the_verdict_names_a_quantile_it_cannot_compare() -> None:
    verdict = demo.ttft_verdict(_report("range-pd", None, None), _report("none", 0.2, 2.0))
    assert "not comparable at TTFT p50 (range-pd has no successful request)" in verdict
    assert "slower" not in verdict and "faster" not in verdict


@pytest.mark.timeout(30)
def test_results_show_the_pd_table_then_the_fleet_table_with_shares_and_verdicts() -> None:
    fleet = _fleet_reports()
    text = demo.results_text(_pd_report(), _report("none", 0.2, 2.0), fleet, "LMCACHE LINE")
    pd_at, fleet_at = text.index("range-pd/none"), text.index("prefix-range/prefix-none")
    assert pd_at < text.index("verdict, range-pd against none") < fleet_at
    assert "prefix-none/none" not in text and "range-pd/prefix-none" not in text, "each table has its own baseline"
    assert text.index("per engine:") > fleet_at
    assert f"prefix-range  {ENGINE_B}: 2000 prompt tokens, 60.0% from its own prefix cache, 15.0% loaded from the " \
           "shared tier" in text
    assert f"prefix-none   {ENGINE_A}: 16000 prompt tokens, 68.8% from its own prefix cache" in text
    verdict = next(line for line in text.splitlines() if line.startswith("verdict, prefix-range"))
    assert "faster at TTFT p50 (0.200 s against 0.250 s, 0.80x) and slower at TTFT p99 (1.200 s against 0.800 s, " \
           "1.50x)" in verdict
    assert text.splitlines()[-1] == "LMCACHE LINE"


@pytest.mark.timeout(30)
def test_results_without_the_fleet_have_the_pd_table_only() -> None:
    text = demo.results_text(_pd_report(), _report("none", 0.2, 2.0), [], "LMCACHE LINE")
    assert "range-pd/none" in text and "prefix-none" not in text and "per engine:" not in text


def _replay_parser() -> Any:
    spec = importlib.util.spec_from_file_location("bench_replay", Path(__file__).resolve().parents[2] / "bench" /
                                                  "replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


@pytest.mark.timeout(60)
def test_the_lmcache_hint_is_a_replay_command_on_the_demos_trace_and_model(tmp_path: Path) -> None:
    trace = load_trace(None, count=None, token_scale=None, duration_s=90.0)
    hint = demo.lmcache_hint(trace_path=None, count=None, token_scale=None, model_size="bench", trace=trace)
    setup, command = hint.split(": ", 1)[1].split(", then ")
    assert setup == "bash bench/setup_lmcache_env.sh"
    argv = shlex.split(command)
    assert argv[:2] == [".venv/bin/python", "bench/replay.py"]
    args = _replay_parser()(argv[2:])
    assert args.configs == "none,range,lmcache" and args.model_size == "bench" and args.block_size == 64
    assert args.synthetic_requests == 40 and args.token_scale == pytest.approx(1 / 16) and args.trace is None

    path = tmp_path / "my trace.jsonl"
    write_mooncake(synthetic_trace(300, seed=3, request_rate_per_s=0.01), path)
    trace = load_trace(str(path), count=50, token_scale=None, duration_s=60.0)
    hint = demo.lmcache_hint(trace_path=str(path), count=50, token_scale=None, model_size="tiny", trace=trace)
    args = _replay_parser()(shlex.split(hint.split(", then ")[1])[2:])
    assert args.trace == str(path) and args.conversations and args.count == 50
    assert args.token_scale == pytest.approx(1 / 32) and args.time_scale < 1.0


@pytest.mark.timeout(30)
def test_failures_are_failed_requests_in_any_replay_or_no_load_in_pd() -> None:
    fleet = _fleet_reports(range_errors=2)
    assert demo.failures([_report("none", 0.2, 2.0), _pd_report(), *_fleet_reports()], _pd_report()) == []
    failed = demo.failures([_report("none", 0.2, 2.0), _pd_report(), *fleet], _pd_report(loaded_tokens=0))
    assert failed == ["prefix-range: 2 of 40 requests failed (HTTP 500 x2)",
                      "range-pd: the decode engine loaded no token from the tier"]


@pytest.fixture
def faked_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The demo's engine phases replaced by reports made here (no model, no engine, no plot); records the calls."""
    import range_connector.bench.fleet as fleet_module
    import range_connector.bench.replay_report as replay_report
    import range_connector.bench.trace_prompts as trace_prompts
    import range_connector.testing.tiny_models as tiny_models

    calls: dict[str, Any] = {"phases": [], "fleet_errors": 0}
    fleet = {}

    def run_fleet(config: str, model_dir: Path, run_dir: Path, *args: Any, **kwargs: Any) -> ReplayReport:
        calls["phases"].append(config)
        if not fleet:
            fleet.update((r.label, r) for r in _fleet_reports(range_errors=calls["fleet_errors"]))
        return fleet[config]

    def phase(name: str, report: ReplayReport) -> Any:
        return lambda *args, **kwargs: calls["phases"].append(name) or report

    monkeypatch.setattr(tiny_models, "build_model", lambda kind, size: tmp_path / "model")
    monkeypatch.setattr(trace_prompts, "normal_vocab_token_ids", lambda model_dir: list(range(100, 30_000)))
    monkeypatch.setattr(replay_report, "write_plots", lambda prefix, reports: [])
    monkeypatch.setattr(demo, "run_disaggregated", phase("range-pd", _pd_report()))
    monkeypatch.setattr(demo, "run_baseline", phase("none", _report("none", 0.2, 2.0)))
    monkeypatch.setattr(fleet_module, "run_fleet", run_fleet)
    return calls


@pytest.mark.timeout(60)
def test_the_fleet_phase_runs_after_pd_and_none_and_the_json_keeps_all_four(faked_runs: dict[str, Any],
                                                                            tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--demo-dir", str(tmp_path / "demo")]) == 0
    assert faked_runs["phases"] == ["range-pd", "none", "prefix-none", "prefix-range"]
    out = capsys.readouterr().out
    assert out.index("range-pd/none") < out.index("prefix-range/prefix-none") < out.index("bench/setup_lmcache_env.sh")
    assert "FAILED" not in out
    [path] = (tmp_path / "demo" / "results").glob("demo-*.json")
    doc = json.loads(path.read_text())
    assert [r["label"] for r in doc["reports"]] == ["none", "range-pd", "prefix-none", "prefix-range"]
    assert doc["ratios_vs_prefix-none"]["prefix-range"]["TTFT p50 (s)"] == pytest.approx(0.8)
    assert doc["comparisons"] == {"none": ["range-pd"], "prefix-none": ["prefix-range"]}
    assert [v.split(":")[0] for v in doc["verdicts"]] == ["verdict, range-pd against none (one engine without a "
                                                          "connector)", "verdict, prefix-range against prefix-none "
                                                          "(two engines behind the prefix-aware proxy without a "
                                                          "connector)"]


@pytest.mark.timeout(60)
def test_no_fleet_skips_the_fleet_phase(faked_runs: dict[str, Any], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-fleet", "--demo-dir", str(tmp_path / "demo")]) == 0
    assert faked_runs["phases"] == ["range-pd", "none"]
    out = capsys.readouterr().out
    assert "range-pd/none" in out and "prefix-none" not in out
    [path] = (tmp_path / "demo" / "results").glob("demo-*.json")
    assert [r["label"] for r in json.loads(path.read_text())["reports"]] == ["none", "range-pd"]


@pytest.mark.timeout(60)
def test_a_failed_fleet_request_fails_the_demo_after_printing_the_tables(faked_runs: dict[str, Any], tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    faked_runs["fleet_errors"] = 1
    assert main(["--demo-dir", str(tmp_path / "demo")]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "FAILED: prefix-range: 1 of 40 requests failed (HTTP 500 x1)"
    assert any("prefix-range/prefix-none" in line for line in out)
