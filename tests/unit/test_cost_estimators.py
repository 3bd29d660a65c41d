"""Online estimates of R, B and T0, the gate built on them, its counters, and the calibration file.

Time is simulated (a counter passed as ``now_s``); nothing sleeps. The simulated tier follows the shape of the
latency/bandwidth wrapper of issue 5: a fixed delay per load plus bytes at a capped rate, per shard.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from range_connector.cost.calibration_file import (
    Calibration,
    fit_prefill_rate,
    fit_tier_line,
    load_calibration,
    write_calibration,
)
from range_connector.cost.decision import Action, decide
from range_connector.cost.estimators import (
    MAX_BANDWIDTH_BYTES_PER_S,
    MAX_T0_S,
    MAX_TOKENS_PER_S,
    MIN_BANDWIDTH_BYTES_PER_S,
    MIN_TOKENS_PER_S,
    RateEstimator,
    TierEstimator,
)
from range_connector.cost.gate import CostGate, DecisionStats, GateConfig
from range_connector.cost.model import PrefillRate, TierEstimate
from range_connector.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


# ------------------------------------------------------------------------------------------ rate
def test_rate_estimator_converges_to_the_engine_speed_keeping_the_curve_shape() -> None:
    seed = PrefillRate(1e-4, 2e-9)
    engine = seed.scaled(2.5)  # the served engine is 2.5x slower than calibrated
    est = RateEstimator(seed, alpha=0.2)
    rng = random.Random(0)
    for _ in range(60):
        ctx, n = rng.randrange(0, 8000), rng.randrange(256, 2048)
        est.observe(n, engine.time_s(ctx, ctx + n) * rng.uniform(0.95, 1.05), ctx)
    assert est.rate.linear_s_per_token == pytest.approx(engine.linear_s_per_token, rel=0.05)
    assert est.rate.attention_s_per_token2 == pytest.approx(engine.attention_s_per_token2, rel=0.05)
    assert est.num_samples == 60


def test_rate_estimator_bounds_and_ignores_bad_samples() -> None:
    est = RateEstimator(PrefillRate.constant(1000.0), alpha=1.0, min_tokens=32)
    est.observe(1000, 4.0)  # 4x slower, taken at once with alpha 1
    assert est.rate.tokens_per_s() == pytest.approx(250.0)
    est.observe(1000, 1e6)  # one absurd step moves the rate by at most 4x
    assert est.rate.tokens_per_s() == pytest.approx(250.0 / 4)
    for _ in range(50):
        est.observe(1000, 1e9)
    assert est.rate.tokens_per_s() == pytest.approx(MIN_TOKENS_PER_S)
    for _ in range(50):
        est.observe(1000, 1e-9)
    assert est.rate.tokens_per_s() == pytest.approx(MAX_TOKENS_PER_S)
    before = est.rate
    for bad in ((1000, math.nan, 0), (1000, -1.0, 0), (-5, 1.0, 0), (1000, 1.0, -1), (8, 1.0, 0)):
        est.observe(*bad)
    assert est.rate == before  # NaN, negative and decode-sized steps do not move the rate
    with pytest.raises(ValueError, match="alpha"):
        RateEstimator(PrefillRate.constant(1.0), alpha=0.0)


def test_typical_step_length_follows_the_steps() -> None:
    est = RateEstimator(PrefillRate.constant(1000.0), alpha=0.5, seed_step_s=1.0)
    for _ in range(20):
        est.observe(1, 0.02)  # decode steps: too few prefill tokens for the rate, but they are steps
    assert est.step_s == pytest.approx(0.02, rel=1e-3)
    assert est.rate.tokens_per_s() == pytest.approx(1000.0)


# ------------------------------------------------------------------------------------------ tier
def test_tier_estimator_converges_to_t0_and_bandwidth() -> None:
    true = TierEstimate(3e9, 0.004)
    est = TierEstimator({"valkey": [TierEstimate(1e9, 0.05)]}, TierEstimate(1e10, 0.001), alpha=0.2)
    rng = random.Random(1)
    for _ in range(80):
        n = rng.randrange(1 * MiB, 256 * MiB)
        est.observe("valkey", 0, n, (true.t0_s + n / true.bandwidth_bytes_per_s) * rng.uniform(0.97, 1.03))
    got = est.estimate("valkey", 0)
    assert got.bandwidth_bytes_per_s == pytest.approx(true.bandwidth_bytes_per_s, rel=0.1)
    assert got.t0_s == pytest.approx(true.t0_s, abs=0.002)
    assert est.num_samples("valkey", 0) == 80
    assert est.estimate("valkey", 1) == est.estimate("valkey", 1)  # an unnamed shard starts from the last seed


def test_loads_of_one_size_predict_that_size_exactly() -> None:
    # One size cannot separate T0 from 1/B; the line must still predict that size, and stay near the truth.
    est = TierEstimator({}, TierEstimate(1e9, 0.01), alpha=0.3)
    for _ in range(40):
        est.observe("file", 0, 64 * MiB, 0.01 + 64 * MiB / 5e8)
    got = est.estimate("file", 0)
    assert got.t0_s + 64 * MiB / got.bandwidth_bytes_per_s == pytest.approx(0.01 + 64 * MiB / 5e8, rel=1e-3)
    assert got.bandwidth_bytes_per_s == pytest.approx(5e8, rel=0.1)


def test_a_load_that_ran_out_of_time_teaches_only_that_the_tier_is_slower() -> None:
    # A load cut off at its deadline took at least that long: faster than predicted says nothing (ignored);
    # slower than predicted is learnt (the tier that timed out is not offered the same hit on the old estimate).
    est = TierEstimator({}, TierEstimate(1e9, 0.01), alpha=0.3)
    n = 96 * MiB
    seeded = est.estimate("file", 0)
    predicted = seeded.t0_s + n / seeded.bandwidth_bytes_per_s
    est.observe("file", 0, n, predicted / 2, lower_bound=True)
    assert est.num_samples("file", 0) == 0 and est.estimate("file", 0) == seeded
    est.observe("file", 0, n, 4 * predicted, lower_bound=True)
    got = est.estimate("file", 0)
    assert est.num_samples("file", 0) == 1
    assert got.t0_s + n / got.bandwidth_bytes_per_s >= 3 * predicted


def test_a_probe_of_a_refused_tier_is_trusted_sooner_than_a_load() -> None:
    # While a tier is refused, probes are its only fresh samples: one that is 1.6x faster than the (slow) history
    # predicts moves the line onto it at once; the same sample from an ordinary load only nudges it.
    def slow_history() -> TierEstimator:
        est = TierEstimator({}, TierEstimate(1e9, 0.01), alpha=0.3)
        for _ in range(10):
            est.observe("file", 0, 96 * MiB, 0.01 + 96 * MiB / 5e7)
        return est
    n = 32 * MiB
    plain, probed = slow_history(), slow_history()
    before = plain.estimate("file", 0)
    fast_s = (before.t0_s + n / before.bandwidth_bytes_per_s) / 1.6
    plain.observe("file", 0, n, fast_s)
    probed.observe("file", 0, n, fast_s, probe=True)

    def predicted(e: TierEstimator) -> float:
        got = e.estimate("file", 0)
        return got.t0_s + n / got.bandwidth_bytes_per_s
    assert predicted(probed) == pytest.approx(fast_s, rel=0.05)
    assert predicted(plain) > 1.25 * fast_s


def test_tier_estimates_stay_within_bounds() -> None:
    est = TierEstimator({}, TierEstimate(1e9, 0.001))
    for _ in range(30):
        est.observe("valkey", 0, 1, 1e6)
    slow = est.estimate("valkey", 0)
    assert slow.bandwidth_bytes_per_s >= MIN_BANDWIDTH_BYTES_PER_S * (1 - 1e-9) and slow.t0_s <= MAX_T0_S
    for _ in range(30):
        est.observe("valkey", 0, 1 << 40, 1e-9)
    fast = est.estimate("valkey", 0)
    assert fast.bandwidth_bytes_per_s <= MAX_BANDWIDTH_BYTES_PER_S * (1 + 1e-9) and fast.t0_s >= 0
    before = est.estimate("valkey", 0)
    for bad in ((0, 1.0), (-1, 1.0), (100, math.nan), (100, -1.0), (100, math.inf)):
        est.observe("valkey", 0, *bad)
    assert est.estimate("valkey", 0) == before


def test_probes_are_rate_limited_per_backend() -> None:
    est = TierEstimator({}, TierEstimate(1e9, 0.0), probe_interval_s=2.0)
    assert est.should_probe("valkey", 100.0)
    assert not est.should_probe("valkey", 101.9)
    assert est.should_probe("file", 101.9)
    assert est.should_probe("valkey", 102.0)


def test_probes_also_wait_for_refused_offers_when_requests_are_sparse() -> None:
    # Requests 10 s apart (seconds-long CPU prefills): the time limit alone would make every refusal a probe.
    est = TierEstimator({}, TierEstimate(1e9, 0.0), probe_interval_s=1.0, probe_every_refusals=4)
    probes = [est.should_probe("file", 10.0 * i) for i in range(13)]
    assert probes == [True, False, False, False, True, False, False, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="probe_every_refusals"):
        TierEstimator({}, TierEstimate(1e9, 0.0), probe_every_refusals=0)


# ------------------------------------------------------------------------------------------ slow tier, end to end
@dataclass
class SimulatedTier:
    """Per shard: a load of n bytes takes ``t0_s + n / bandwidth_bytes_per_s`` (the wrapper's shape)."""

    bandwidth_bytes_per_s: float
    t0_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.t0_s + num_bytes / self.bandwidth_bytes_per_s


BYTES_PER_TOKEN = 131072.0  # the bench GQA model's KV per token
FAST = SimulatedTier(2e9, 0.002)
REQUEST_INTERVAL_S = 0.25
PROMPT = 4097  # hit 4096: fast load ~0.14 s, recompute ~0.41 s at 10k tokens/s


def make_gate(probe_interval_s: float = 1.0) -> CostGate:
    calibration = Calibration(prefill=PrefillRate.constant(10_000.0),
                              tiers={"valkey": (TierEstimate(FAST.bandwidth_bytes_per_s, FAST.t0_s),) * 2})
    return CostGate("valkey", 2, BYTES_PER_TOKEN, num_layers=32, block_size=128, chunk_tokens=256,
                    calibration=calibration, config=GateConfig(probe_interval_s=probe_interval_s, seed_step_s=0.05))


def serve(gate: CostGate, tier_at, num_requests: int, start: int = 0) -> list:
    """Send requests every REQUEST_INTERVAL_S through the gate; every load is timed on ``tier_at(i)``."""
    decisions = []
    for i in range(start, start + num_requests):
        d = gate.decide(PROMPT, 0, PROMPT - 1, now_s=i * REQUEST_INTERVAL_S)
        gate.commit(d)
        if d.num_new_tokens:
            per_shard = gate.shard_bytes(d)
            times = [tier_at(i).seconds(per_shard) for _ in range(gate.num_shards)]
            for shard_idx, seconds in enumerate(times):
                gate.observe_load(shard_idx, per_shard, seconds)
            gate.record_load(d, max(times))
        decisions.append(d)
    return decisions


@pytest.mark.parametrize("slow", [SimulatedTier(1e8, 0.02), SimulatedTier(1e8, FAST.t0_s),
                                  SimulatedTier(FAST.bandwidth_bytes_per_s, 1.0)],
                         ids=["latency-and-bandwidth", "bandwidth-only", "latency-only"])
def test_case_C21_cost_model_stops_choosing_a_tier_slower_than_recompute(slow: SimulatedTier) -> None:
    gate = make_gate()
    slow_from, slow_until, total = 8, 48, 70

    def tier_at(i: int) -> SimulatedTier:
        return slow if slow_from <= i < slow_until else FAST

    d = serve(gate, tier_at, total)
    taken = [x.action is Action.TAKE and not x.is_probe for x in d]
    assert all(taken[:slow_from])
    # The first load on the slowed tier is paid once; from the next request on the tier is refused.
    assert not any(taken[slow_from + 1:slow_until])
    refused = [i for i in range(slow_from, slow_until) if d[i].action is Action.REFUSE]
    assert refused and refused[0] <= slow_from + 2
    # While refused, probes re-measure it at most once per probe interval, one short whole-chunk load each.
    probes = [x for x in d[slow_from:slow_until] if x.is_probe]
    slow_seconds = (slow_until - slow_from) * REQUEST_INTERVAL_S
    assert 1 <= len(probes) <= slow_seconds / 1.0 + 1
    assert all(p.num_new_tokens == 256 for p in probes)
    # After the tier recovers it is taken again within a few requests (the next probe sees it fast).
    back = next(i for i in range(slow_until, total) if taken[i])
    assert back - slow_until <= 1.0 / REQUEST_INTERVAL_S + 2
    assert all(taken[back:])
    counts = gate.stats.snapshot()
    assert counts["decisions_taken"] == sum(taken)
    assert counts["decisions_probes"] == len([x for x in d if x.is_probe])
    assert counts["decisions_refused"] == len([x for x in d if x.action is Action.REFUSE])


def test_fast_path_is_what_makes_the_refusal_quick() -> None:
    # A 4x slowdown (load 0.54 s against 0.41 s of recompute): without the jump the moving estimate pays for
    # several slow loads before it refuses; with it, one.
    slow = SimulatedTier(FAST.bandwidth_bytes_per_s / 4, FAST.t0_s * 4)
    slow_loads = {}
    for jump_ratio in (2.0, 1e9):
        gate = make_gate()
        gate.tiers.jump_ratio = jump_ratio
        d = serve(gate, lambda i: slow if i >= 4 else FAST, 30)
        slow_loads[jump_ratio] = len([x for x in d[4:] if x.num_new_tokens and not x.is_probe])
    assert slow_loads[2.0] == 1
    assert slow_loads[1e9] >= 2


def test_decision_stats_count_actions_and_predicted_vs_realised() -> None:
    stats = DecisionStats()
    args = dict(bytes_per_token=1e3, rate=1e4, num_layers=8, block_size=16, chunk_tokens=64, step_s=1.0)
    take = decide(4097, 0, 4096, tier=TierEstimate(1e12, 0.0), **args)
    refuse = decide(4097, 0, 4096, tier=TierEstimate(1e3, 1.0), **args)
    probe = decide(4097, 0, 4096, tier=TierEstimate(1e3, 1.0), probe=True, **args)
    shorten = decide(30_001, 0, 30_000, tier=TierEstimate(5e6, 0.001), **{**args, "step_s": 10.0})
    nothing = decide(4097, 4096, 4096, tier=TierEstimate(1e12, 0.0), **args)
    assert [x.action for x in (take, refuse, probe, shorten)] == [Action.TAKE, Action.REFUSE, Action.SHORTEN,
                                                                   Action.SHORTEN]
    for x in (take, refuse, probe, shorten, nothing):
        stats.record(x)
    stats.record_load(0.5, 0.75)
    stats.record_load(1.0, 1.25)
    stats.record_load(math.inf, 1.0)  # an unusable prediction is not averaged in
    assert stats.snapshot() == {"decisions_taken": 1, "decisions_refused": 1, "decisions_probes": 1,
                                "decisions_shortened": 1, "loads_pipelined": 2, "loads_async": 1, "predicted_load_s": 1.5,
                                "realised_load_s": 2.0, "realised_loads": 2}
    assert list(stats.recent) == [(0.5, 0.75), (1.0, 1.25)]


def test_gate_without_calibration_starts_by_taking_hits() -> None:
    gate = CostGate("valkey", 2, BYTES_PER_TOKEN, num_layers=32, block_size=128, chunk_tokens=256)
    assert gate.decide(PROMPT, 0, PROMPT - 1, now_s=0.0).action is Action.TAKE
    memory = CostGate("memory", 4, BYTES_PER_TOKEN, num_layers=32, block_size=128, chunk_tokens=256)
    assert memory.num_shards == 1  # one process's memory holds every shard


# ------------------------------------------------------------------------------------------ fits
def test_prefill_fit_separates_the_fixed_overhead_from_the_curve() -> None:
    true, overhead = PrefillRate(2e-5, 3e-9), 0.04
    points = [(n, overhead + true.time_s(0, n)) for n in (128, 256, 512, 1024, 2048, 4096)]
    rate, fitted_overhead = fit_prefill_rate(points)
    assert rate.linear_s_per_token == pytest.approx(true.linear_s_per_token, rel=1e-6)
    assert rate.attention_s_per_token2 == pytest.approx(true.attention_s_per_token2, rel=1e-6)
    assert fitted_overhead == pytest.approx(overhead, rel=1e-6)
    linear, _ = fit_prefill_rate([(n, 0.01 + n / 5000) for n in (100, 200, 400)])
    assert linear.attention_s_per_token2 == 0.0 and linear.tokens_per_s() == pytest.approx(5000)
    # Noise that would need a negative coefficient is fitted with that term left out.
    concave, c0 = fit_prefill_rate([(100, 0.1), (200, 0.19), (400, 0.33), (800, 0.55)])
    assert concave.attention_s_per_token2 >= 0 and c0 >= 0


def test_tier_fit_recovers_t0_and_bandwidth() -> None:
    got = fit_tier_line([(n, 0.003 + n / 2.5e9) for n in (MiB, 4 * MiB, 16 * MiB, 64 * MiB)])
    assert got.bandwidth_bytes_per_s == pytest.approx(2.5e9, rel=1e-6)
    assert got.t0_s == pytest.approx(0.003, rel=1e-6)


@pytest.mark.parametrize("points", [[(100, 1.0)], [(100, 1.0), (100, 2.0)], [(100, 2.0), (200, 1.0)],
                                    [(100, math.nan), (200, 1.0)], [(1, 2, 3)], [(-1, 1.0), (2, 1.0)]])
def test_fits_reject_unusable_points(points) -> None:
    with pytest.raises(ValueError, match="^points:"):
        fit_prefill_rate(points)
    with pytest.raises(ValueError, match="^points:"):
        fit_tier_line(points)


# ------------------------------------------------------------------------------------------ calibration file
def sample_calibration() -> Calibration:
    return Calibration(prefill=PrefillRate(2e-5, 3e-9), prefill_overhead_s=0.04,
                       tiers={"valkey": (TierEstimate(2.5e9, 0.003), TierEstimate(2.4e9, 0.004)),
                              "file": (TierEstimate(1.2e9, 0.0002),)},
                       bytes_per_token=131072.0, model="/models/bench", created_unix_s=1.7e9,
                       prefill_points=((128, 0.05), (256, 0.06)),
                       tier_points={"valkey": (((MiB, 0.004),), ((MiB, 0.005),)), "file": (((MiB, 0.001),),)})


def test_calibration_file_round_trips(tmp_path: Path) -> None:
    path = write_calibration(sample_calibration(), tmp_path / "sub" / "cal.json")
    assert load_calibration(path) == sample_calibration()
    assert json.loads(path.read_text())["version"] == 1
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    empty = write_calibration(Calibration(), tmp_path / "empty.json")
    assert load_calibration(empty) == Calibration()


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(schema="other"), "schema"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["tiers"]["valkey"][1].update(t0_s=-1.0), "tiers.valkey[1].t0_s"),
        (lambda d: d["tiers"]["valkey"][0].pop("bandwidth_bytes_per_s"), "tiers.valkey[0].bandwidth_bytes_per_s"),
        (lambda d: d["tiers"].update(file=[]), "tiers.file"),
        (lambda d: d["prefill"].update(linear_s_per_token=0), "prefill.linear_s_per_token"),
        (lambda d: d["prefill"].update(points=[[1]]), "prefill.points"),
        (lambda d: d.update(bytes_per_token="big"), "bytes_per_token"),
        (lambda d: d.update(model=3), "model"),
    ],
)
def test_bad_calibration_file_is_one_line_naming_the_key(tmp_path: Path, edit, key: str) -> None:
    doc = sample_calibration().to_json()
    edit(doc)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as info:
        load_calibration(path)
    assert str(info.value).startswith(f"{path}:{key}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"])
def test_unreadable_calibration_file_is_one_line_naming_the_path(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_calibration(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
