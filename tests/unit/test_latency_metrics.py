"""Latency histograms, occupancy gauges and requests that do not read the connector's answer
(:mod:`range_connector.histograms`).

The aggregation is checked against prometheus_client itself: values observed on two workers, carried as stats
deltas, summed as vLLM sums them and replayed by :class:`RangePromMetrics`, give the same buckets, count and sum as
one histogram that observed every value. The observation points run in the scheduler/worker harness (real
``RangeScheduler`` and ``RangeWorker``); durations there come from a virtual clock where the value matters.
"""

from __future__ import annotations

import functools
import itertools

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import range_connector.scheduler.lookup as lookup_module
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.tiered import TieredBackend
from range_connector.config.tree import TierConfig
from range_connector.connector.stats import RangeConnectorStats, RangePromMetrics
from range_connector.histograms import (
    HISTOGRAMS,
    LATENCY_BUCKETS_S,
    bucket_index,
    bucket_key,
    gauge_key,
    observe,
)
from range_connector.metrics import stats_delta, tier_key
from range_connector.worker.counters import Counters
from range_connector.worker.observe import bank_gauges
from tests.unit.scheduler_worker_harness import FakeRequest, MiB, Engine, produce, prompt_tokens, shard_backends, wrap

pytestmark = pytest.mark.timeout(60)


class _Config:
    kv_transfer_config = None


def _prom(registry: CollectorRegistry) -> RangePromMetrics:
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    return RangePromMetrics(_Config(), types, ["model_name", "engine"], {0: ["tiny", "0"]})  # type: ignore[arg-type]


def _samples(registry: CollectorRegistry, name: str, **labels: str) -> dict[str, float]:
    """``le -> cumulative count`` of histogram ``name``'s buckets, plus ``count`` and ``sum``."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name.startswith(name) and all(s.labels.get(k) == v for k, v in labels.items()):
                if s.name.endswith("_bucket"):
                    out[s.labels["le"]] = s.value
                elif s.name.endswith("_count") or s.name.endswith("_sum"):
                    out[s.name.rsplit("_", 1)[1]] = s.value
    return out


def _hist_counts(stats, name: str, tier: str) -> int:
    n = len(HISTOGRAMS[name].buckets) + 1
    return sum(int(stats.get(bucket_key(name, tier, i), 0)) for i in range(n))


# ---------------------------------------------------------------------------------------------------- aggregation
def test_bucket_index_follows_prometheus_le() -> None:
    b = LATENCY_BUCKETS_S
    assert bucket_index(b, 0.0) == 0
    assert bucket_index(b, b[0]) == 0  # a value on a bound is in that bucket (le)
    assert bucket_index(b, b[0] * 1.0001) == 1
    assert bucket_index(b, 0.003) == b.index(0.005)
    assert bucket_index(b, b[-1]) == len(b) - 1
    assert bucket_index(b, 1e9) == len(b)  # +Inf


def test_two_workers_histograms_merge_into_the_histogram_of_all_their_values() -> None:
    worker_values = [[0.00002, 0.0004, 0.0004, 0.003, 1.7, 45.0], [0.00001, 0.0004, 0.02, 0.02, 3.0]]
    later = [[0.0004, 7.0], [0.00001]]  # a second interval: only deltas travel
    workers = [Counters(), Counters()]
    last: list[dict] = [{}, {}]
    registry = CollectorRegistry()
    prom = _prom(registry)
    for interval in (worker_values, later):
        total = RangeConnectorStats()
        for w, values in enumerate(interval):
            for v in values:
                observe(workers[w], "load_seconds", "valkey", v)
            total.aggregate(RangeConnectorStats(data=stats_delta(workers[w].snapshot(), last[w])))
        prom.observe(total.to_dict(), engine_idx=0)
    reference_registry = CollectorRegistry()
    reference = Histogram("ref_seconds", "all values", buckets=LATENCY_BUCKETS_S, registry=reference_registry)
    for v in itertools.chain(*worker_values, *later):
        reference.observe(v)
    got = _samples(registry, "vllm:range_load_seconds", tier="valkey")
    want = _samples(reference_registry, "ref_seconds")
    assert got.pop("sum") == pytest.approx(want.pop("sum"))
    assert got == want and want["count"] == 14  # every bucket, +Inf and the count
    assert _samples(registry, "vllm:range_load_seconds", tier="memory")["count"] == 0  # other tiers untouched


def test_gauges_read_the_sum_of_every_workers_latest_level() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    last: list[dict] = [{}, {}]

    def report(levels: list[int]) -> None:
        total = RangeConnectorStats()
        for w, level in enumerate(levels):
            total.aggregate(RangeConnectorStats(data=stats_delta({gauge_key("banks_in_use"): level}, last[w])))
        prom.observe(total.to_dict(), engine_idx=0)

    def value() -> float | None:
        return registry.get_sample_value("vllm:range_banks_in_use", {"model_name": "tiny", "engine": "0"})

    report([2, 1])
    assert value() == 3
    report([0, 1])
    assert value() == 1
    report([0, 0])
    assert value() == 0


# ---------------------------------------------------------------------------------------------------- observation points
def test_lookup_is_timed_on_the_schedulers_clock_and_bucketed_by_tier(monkeypatch) -> None:
    clock = _ticking(monkeypatch, 0.003)
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=90)
    a, _ = produce(inner, prompt)
    b = Engine(wrap(inner), seed=91)
    b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0)
    stats = b.sched.counters()
    idx = LATENCY_BUCKETS_S.index(0.005)  # 3 ms: one tick between the lookup's two readings
    assert stats[bucket_key("lookup_seconds", "memory", idx)] == 1
    assert stats[bucket_key("lookup_seconds", "memory", idx) + "s"] == pytest.approx(0.003)
    assert _hist_counts(stats, "lookup_seconds", "memory") == 1
    assert clock.readings >= 2
    a.close()
    b.close()


def test_loads_and_saves_are_observed_once_per_job_and_write(monkeypatch) -> None:
    inner = shard_backends(2, 2)
    prompt = prompt_tokens(150, seed=92)
    a, _ = produce(inner, prompt, num_shards=2)
    saved = a.worker.stats
    assert _hist_counts(saved, "save_seconds", "memory") == saved["saved_stripes"] > 0
    b = Engine(wrap(inner, "bank"), num_shards=2, seed=93)
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b.step()
    stats = b.sched.counters()
    assert stats[tier_key("loads", "memory")] == 1
    assert _hist_counts(stats, "load_seconds", "memory") == 1  # once per job, as vllm:range_tier_loads_total
    total_s = sum(v for k, v in stats.items() if k.startswith("hist:load_seconds@memory") and k.endswith("s"))
    assert total_s == pytest.approx(stats[tier_key("load_seconds", "memory")])
    assert _hist_counts(b.worker.stats, "first_layer_seconds", "memory") == 1
    gauges = bank_gauges(b.worker.banks)  # the banked load allocated staging memory and gave every bank back
    assert gauges[gauge_key("bank_bytes")] > 0 and gauges[gauge_key("banks_in_use")] == 0
    assert gauges[gauge_key("banks")] == b.config.num_banks
    a.close()
    b.close()


def test_a_hierarchy_times_each_tiers_write_under_its_own_tier() -> None:
    dram, far = MemoryBackend(64 * MiB, name="dram"), MemoryBackend(64 * MiB, name="far")
    tiers = (TierConfig("memory", index=0), TierConfig("file", index=1))
    eng = Engine([TieredBackend([dram, far])], lookup_backends=[TieredBackend([None, far])], tiers=tiers, seed=94)
    eng.admit(FakeRequest("P-0", prompt_tokens(150, seed=94)))
    eng.step()
    assert eng.worker.wait_for_saves(30)
    stats = eng.worker.stats
    stripes = stats["saved_stripes"]
    assert stripes > 0
    assert _hist_counts(stats, "save_seconds", "memory") == stripes  # the near write, in the step
    assert _hist_counts(stats, "save_seconds", "file") == stripes  # the far copy, on the far-writer thread
    eng.close()


def test_the_gates_prediction_is_set_against_the_realised_load_by_tier() -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=95)
    a, _ = produce(inner, prompt)
    b = Engine(wrap(inner), seed=96, load_mode="auto")
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b.step(forward=False)
    stats = b.sched.counters()
    predicted = stats[tier_key("gate_predicted_load_seconds", "memory")]
    realised = stats[tier_key("gate_realised_load_seconds", "memory")]
    assert predicted > 0 and realised > 0
    assert _hist_counts(stats, "gate_load_ratio", "memory") == 1
    ratio_sum = sum(v for k, v in stats.items() if k.startswith("hist:gate_load_ratio@memory") and k.endswith("s"))
    assert ratio_sum == pytest.approx(realised / predicted)
    a.close()
    b.close()


def test_leases_of_a_promised_load_show_in_the_gauges_until_it_ends() -> None:
    inner = shard_backends(2, 2)
    prompt = prompt_tokens(150, seed=97)
    a, _ = produce(inner, prompt, num_shards=2, first_step_tokens=None)  # one step: one stripe per shard
    b = Engine(wrap(inner), num_shards=2, seed=98)
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    held = b.sched.counters()
    assert held[gauge_key("leasing_requests")] == 1 and held[gauge_key("leased_stripes")] == 2  # one per shard
    b.step()
    released = b.sched.counters()
    assert released[gauge_key("leasing_requests")] == 0 and released[gauge_key("leased_stripes")] == 0
    a.close()
    b.close()


def test_a_request_that_does_not_read_the_answer_is_no_miss_and_no_decision() -> None:
    """vLLM asks the connector for a prompt-logprobs request and drops the answer (vllm#57596): Range counts it as
    not read, not as a lookup, a decision or left-out hit tokens, and its saves still skip the stored chunks."""
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=99)
    a, _ = produce(inner, prompt)
    b = Engine(wrap(inner), seed=100, load_mode="auto")
    longer = prompt + prompt_tokens(40, seed=101)  # chunks 0-3 stored, chunk 4 new and full
    unread = FakeRequest("B-0", longer)
    unread.skip_reading_prefix_cache = True  # type: ignore[attr-defined]  (vllm.v1.request.Request's attribute)
    assert b.admit(unread) == 0
    res = b.step()
    stats = b.sched.counters()
    assert stats["lookups_not_read"] == 1 and stats["lookups"] == 0
    assert not any(stats.get(k, 0) for k in ("decisions_taken", "decisions_refused", "decisions_shortened",
                                             "decisions_probes"))
    assert [c.chunk_idx for s in res.meta.saves for c in s.chunks] == [4]  # chunks 0-3 are stored: not saved again
    assert b.admit(FakeRequest("B-1", prompt)) == 128  # a request that reads it is a lookup and a decision
    stats = b.sched.counters()
    assert stats["lookups"] == 1 and stats["decisions_taken"] == 1 and stats["lookups_not_read"] == 1
    a.close()
    b.close()


class _Ticks:
    def __init__(self, step_s: float) -> None:
        self.step_s, self.readings = step_s, 0

    def __call__(self) -> float:
        self.readings += 1
        return 1000.0 + self.readings * self.step_s


def _ticking(monkeypatch, step_s: float) -> _Ticks:
    """``time.monotonic`` of the scheduler's lookup module moves ``step_s`` at each reading (the harness's
    ``virtual_monotonic`` seam, with a clock that ticks)."""
    import time
    import types

    clock = _Ticks(step_s)
    fake = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    fake.monotonic = clock
    monkeypatch.setattr(lookup_module, "time", fake)
    return clock
