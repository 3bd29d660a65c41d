"""Range's own counts next to vLLM's: the token tally (loaded / failed / aborted, once per engine), the Prometheus
metrics that carry it to ``/metrics``, and the replay's reading and check of them.

The tally is driven through the scheduler/worker harness of ``scheduler_worker_harness.py`` (real
``RangeScheduler`` and ``RangeWorker``, in-memory stripe stores behind ``FlakyBackend``) and on its own; the
Prometheus side is served over real HTTP by prometheus_client and read back with the replay's own reader.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from range_connector.bench.replay_metrics import RANGE_COUNTERS, connector_check, engine_counts, snapshot_metrics
from range_connector.connector.stats import RangeConnectorStats, RangePromMetrics
from range_connector.kv.metadata import ChunkTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.metrics import GATE_DECISIONS, PROM_COUNTERS, PROM_GATE, LoadTally, tier_key, tokens_per_chunk
from range_connector.testing.processes import free_port
from tests.unit.clocks import WIDE_S, reads_returned, wait_until
from tests.unit.scheduler_worker_harness import (
    Engine,
    FakeRequest,
    flip_byte,
    mutate_stored_value,
    produce,
    prompt_tokens,
    shard_backends,
    stored_ticket,
    wrap,
)

pytestmark = pytest.mark.timeout(60)


def _chunk(chunk_idx: int, positions: tuple[int, ...]) -> ChunkTransfer:
    return ChunkTransfer(chunk_idx, ChunkHash(b"h" * 32), positions, tuple(100 + p for p in positions))


# ---------------------------------------------------------------------------------------------------- the tally
def test_tokens_per_chunk_counts_only_the_promised_tokens() -> None:
    # block 16, 2 blocks a chunk; a local hit of one block, then a load that ends inside block 9 (a stored tail).
    chunks = [_chunk(0, (1,)), _chunk(1, (0, 1)), _chunk(2, (0, 1)), _chunk(3, (0, 1)), _chunk(4, (0, 1))]
    per_chunk = tokens_per_chunk(chunks, first_token=16, num_tokens=149 - 16, block_size=16, blocks_per_chunk=2)
    assert per_chunk == [(0, 16), (1, 32), (2, 32), (3, 32), (4, 21)]
    assert sum(n for _, n in per_chunk) == 149 - 16


def test_tally_settles_pipelined_loads_in_their_step_and_merges_the_workers_failures() -> None:
    tally = LoadTally()
    tally.plan("a", [(0, 32), (1, 32), (2, 32)], is_async=False, preempted=False)
    tally.plan("b", [(0, 32), (1, 32)], is_async=False, preempted=False)
    # Two workers failed request a from different chunks: vLLM recomputes from the first invalid block.
    tally.settle(["a", "b"], [("a", 2), ("a", 1)])
    assert tally.counts == {"loaded_tokens": 32 + 64, "failed_tokens": 64, "aborted_tokens": 0,
                            "preempted_load_tokens": 0}
    assert tally.num_unsettled == 0
    tally.settle(["a"], [("a", 0)])  # a late duplicate report changes nothing
    assert tally.counts["failed_tokens"] == 64


def test_tally_settles_async_loads_when_vllm_reports_them_finished() -> None:
    tally = LoadTally()
    tally.plan("a", [(0, 64)], is_async=True, preempted=False)
    tally.plan("b", [(0, 64)], is_async=True, preempted=True)
    tally.settle(["a"], [])  # one worker is done, another is still loading: not finished for vLLM yet
    assert tally.counts["loaded_tokens"] == 0 and tally.num_unsettled == 2
    tally.settle([], [("a", 0)])  # the other worker failed it in a later step
    tally.request_finished("b")  # the client went away while b's KV was on its way
    tally.settle(["b"], [], finished_recving=["a", "b"])
    assert tally.counts == {"loaded_tokens": 0, "failed_tokens": 64, "aborted_tokens": 64,
                            "preempted_load_tokens": 64}


def test_a_pipelined_request_that_finishes_before_its_report_is_not_aborted() -> None:
    # max_tokens=1: vLLM finishes the request in the step's own output, before the connector sees the worker's.
    tally = LoadTally()
    tally.plan("a", [(0, 32)], is_async=False, preempted=False)
    tally.request_finished("a")
    tally.settle(["a"], [])
    assert tally.counts["loaded_tokens"] == 32 and tally.counts["aborted_tokens"] == 0


# --------------------------------------------------------------------------------------------------- through the halves
def test_corrupt_chunk_counts_its_tokens_and_later_ones_as_failed_not_loaded() -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=81)
    a, _ = produce(inner, prompt)
    t = stored_ticket(inner[0], a.sched._chain(FakeRequest("x", prompt))[0][2], 0)
    assert t is not None
    mutate_stored_value(inner[0], t.stripe_id, 1, flip_byte(t.plane_range(0)[0] + 3))  # chunk 2, layer 1
    b = Engine(wrap(inner), seed=82, verify_checksums=True)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    res = b.step(forward=False)
    assert len(res.invalid_block_ids) == 4  # chunks 2 and 3
    counts = b.sched.counters()
    assert (counts["loaded_tokens"], counts["failed_tokens"], counts["aborted_tokens"]) == (64, 64, 0)
    assert b.worker.stats["failed_blocks"] == 4 and b.worker.stats["loaded_blocks"] == 4
    assert "loaded_tokens" not in b.worker.stats  # tokens are the scheduler's: summing workers would multiply them
    a.close()
    b.close()


def test_tail_load_counts_exactly_the_tokens_vllm_admitted() -> None:
    inner = shard_backends(2, 2)
    prompt = prompt_tokens(150, seed=83)
    p = Engine(inner, num_shards=2, can_load=False, can_save=True, seed=84)
    req = FakeRequest("P-0", prompt)
    req.kv_transfer_params = {"do_remote_decode": True}  # type: ignore[attr-defined]
    p.admit(req)
    p.step()
    c = Engine(wrap(inner), num_shards=2, can_load=True, can_save=False, seed=85)  # type: ignore[arg-type]
    creq = FakeRequest("C-0", prompt)
    creq.kv_transfer_params = {"range": {"version": 1, "settings": p.sched.settings,  # type: ignore[attr-defined]
                                         "num_tokens": 150}}
    assert c.admit(creq) == 149  # ten blocks, the last one partly
    c.step(forward=False)
    assert c.sched.counters()["loaded_tokens"] == 149 and c.worker.stats["loaded_blocks"] == 10
    p.close()
    c.close()


@pytest.mark.parametrize("mode", ["async", "pipelined"])
def test_load_past_its_deadline_is_counted_as_failed(mode: str) -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=86)
    a, _ = produce(inner, prompt)
    flaky = wrap(inner)
    b = Engine(flaky, seed=87, load_mode=mode, load_deadline_s=0.2,  # type: ignore[arg-type]
               backend_timeout_s=WIDE_S)
    for f in flaky:
        f.hold_reads()  # frozen until the load is over (then a timeout error)
        f.read_hang_s = 0.0
    if mode == "async":
        assert b.admit_async(FakeRequest("B-0", prompt)) == 128
        end = time.monotonic() + WIDE_S
        while "B-0" not in b.step().finished_recving:
            assert time.monotonic() < end
            time.sleep(0.01)
    else:
        assert b.admit(FakeRequest("B-0", prompt)) == 128
        b.step(forward=False)
    counts = b.sched.counters()
    assert (counts["loaded_tokens"], counts["failed_tokens"]) == (0, 128)
    for f in flaky:
        f.release_reads()
    reads_returned(b, flaky)  # let the hung read end before the stores close
    a.close()
    b.close()


def test_aborted_async_load_is_counted_as_aborted() -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=88)
    a, _ = produce(inner, prompt)
    flaky = wrap(inner)
    b = Engine(flaky, seed=89, load_mode="async")  # type: ignore[arg-type]
    for f in flaky:
        f.hold_reads()  # the load is still in flight when the client leaves
    assert b.admit_async(FakeRequest("B-0", prompt)) == 128
    b.step()
    wait_until(lambda: sum(f.loads_in_flight for f in flaky) >= 1, "the load's read reached the tier")
    b.abort_waiting("B-0")
    assert b.step().finished_recving == {"B-0"}
    counts = b.sched.counters()
    assert (counts["loaded_tokens"], counts["failed_tokens"], counts["aborted_tokens"]) == (0, 0, 128)
    for f in flaky:
        f.release_reads()
    reads_returned(b, flaky)
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- Prometheus
@pytest.fixture()
def registry() -> CollectorRegistry:
    return CollectorRegistry()


class _Config:
    """The one attribute of ``VllmConfig`` that ``KVConnectorPromMetrics`` reads."""

    kv_transfer_config = None


def _prom(registry: CollectorRegistry, engines: int = 1) -> RangePromMetrics:
    """Range's metrics in a private registry, built as vLLM's ``KVConnectorProm`` builds them (labels
    ``model_name``, ``engine``)."""
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    labelvalues: dict[int, list[object]] = {idx: ["tiny", str(idx)] for idx in range(engines)}
    return RangePromMetrics(_Config(), types, ["model_name", "engine"], labelvalues)  # type: ignore[arg-type]


def test_prom_metrics_count_per_engine_and_ignore_other_keys(registry: CollectorRegistry) -> None:
    prom = _prom(registry, engines=2)
    stats = RangeConnectorStats(data={"loaded_tokens": 100, "failed_tokens": 28, "loaded_bytes": 4096,
                                      "decisions_taken": 2, "decisions_probes": 1, "lookups": 9,
                                      "predicted_load_s": 0.5})
    stats.aggregate(RangeConnectorStats(data={"loaded_tokens": 28}))  # a second worker's interval
    prom.observe(stats.to_dict(), engine_idx=1)
    prom.observe({"loaded_tokens": 5}, engine_idx=0)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", **labels})

    assert value("vllm:range_loaded_tokens_total", engine="1") == 128
    assert value("vllm:range_loaded_tokens_total", engine="0") == 5
    assert value("vllm:range_failed_tokens_total", engine="1") == 28
    assert value("vllm:range_loaded_bytes_total", engine="1") == 4096
    assert value("vllm:range_aborted_tokens_total", engine="1") == 0  # exported at 0 before any observation
    assert value("vllm:range_gate_decisions_total", engine="1", decision="taken") == 2
    assert value("vllm:range_gate_decisions_total", engine="1", decision="probe") == 1
    assert value("vllm:range_gate_decisions_total", engine="1", decision="refused") == 0
    names = {m.name for m in registry.collect()}
    assert "vllm:range_lookups" not in names and "vllm:range_predicted_load_s" not in names


def test_rejected_request_inputs_are_one_counter_labelled_by_kind(registry: CollectorRegistry) -> None:
    from range_connector.scheduler.request_input import REJECTION_STATS

    prom = _prom(registry)
    prom.observe({REJECTION_STATS["num_tokens"]: 2, REJECTION_STATS["cache_salt"]: 1})
    name = "vllm:range_rejected_request_inputs_total"
    assert registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", "kind": "num_tokens"}) == 2
    assert registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", "kind": "cache_salt"}) == 1
    assert registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", "kind": "settings"}) == 0


def test_replay_reader_names_are_the_exported_ones() -> None:
    exported = {f"{name}_total" for name, _ in PROM_COUNTERS.values()}
    assert set(RANGE_COUNTERS.values()) <= exported
    assert all(name.startswith("vllm:range_") for name, _ in [*PROM_COUNTERS.values(), PROM_GATE])
    assert set(GATE_DECISIONS) == {"decisions_taken", "decisions_shortened", "decisions_refused",
                                   "decisions_probes", "loads_not_started_late"}


def test_skipped_saves_far_copies_and_late_hits_are_exported_by_label(registry: CollectorRegistry) -> None:
    # What a cache loses silently otherwise: saves not written (by reason), far copies a hierarchy skipped (by tier),
    # hits a fixed load mode did not start because their load was predicted late.
    from range_connector.metrics import SAVES_SKIPPED_STATS

    prom = _prom(registry)
    prom.observe({SAVES_SKIPPED_STATS["backlog"]: 3, SAVES_SKIPPED_STATS["tier_down"]: 1, "save_errors": 2,
                  tier_key("far_copies_skipped", "valkey"): 4, "loads_not_started_late": 5})

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert value("vllm:range_saves_skipped_total", reason="backlog") == 3
    assert value("vllm:range_saves_skipped_total", reason="tier_down") == 1
    assert value("vllm:range_saves_skipped_total", reason="error") == 2
    assert value("vllm:range_saves_skipped_total", reason="no_space") == 0
    assert value("vllm:range_tier_far_copies_skipped_total", tier="valkey") == 4
    assert value("vllm:range_tier_far_copies_skipped_total", tier="file") == 0
    assert value("vllm:range_gate_decisions_total", decision="late") == 5


@pytest.fixture()
def served(registry: CollectorRegistry) -> Iterator[tuple[str, CollectorRegistry]]:
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{port}", registry
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_replay_reads_range_counters_over_http_and_checks_them(served: tuple[str, CollectorRegistry]) -> None:
    url, registry = served
    prom = _prom(registry)
    # vLLM's own counters of the same engine (their names as vLLM 0.32 registers them)
    hits = Counter("vllm:external_prefix_cache_hits", "", ["model_name", "engine"], registry=registry)
    prompt = Counter("vllm:prompt_tokens", "", ["model_name", "engine"], registry=registry)
    before = snapshot_metrics([url], timeout_s=5.0)
    assert not before.errors
    hits.labels("tiny", "0").inc(512)
    prompt.labels("tiny", "0").inc(2000)
    prom.observe({"loaded_tokens": 384, "failed_tokens": 128}, 0)
    after = snapshot_metrics([url], timeout_s=5.0)
    counts = engine_counts(before, after)
    assert counts.range_engines == (url,)
    assert counts.connector_check == {"external_hit_tokens": 512, "loaded_tokens": 384, "failed_tokens": 128,
                                      "aborted_tokens": 0, "preempted_load_tokens": 0, "difference_tokens": 0,
                                      "agrees": True}
    assert counts.served_from_tier_share == pytest.approx(384 / 2000)  # Range's verified count ...
    assert counts.external_hit_share == pytest.approx(512 / 2000)  # ... not vLLM's admission count
    doc = counts.to_dict()
    assert doc["connector_check_per_engine"][url]["agrees"] is True
    hits.labels("tiny", "0").inc(128)  # a hit Range never settled: the check says so
    counts = engine_counts(before, snapshot_metrics([url], timeout_s=5.0))
    assert counts.connector_check["difference_tokens"] == 128 and counts.connector_check["agrees"] is False


def test_an_engine_without_range_has_no_check(served: tuple[str, CollectorRegistry]) -> None:
    url, registry = served
    Counter("vllm:external_prefix_cache_hits", "", ["model_name", "engine"], registry=registry).labels(
        "tiny", "0").inc(64)
    snap = snapshot_metrics([url], timeout_s=5.0)
    counts = engine_counts(snap, snap)
    assert counts.range_engines == () and counts.connector_check is None
    assert counts.served_from_tier_share is None and counts.to_dict()["connector_check_per_engine"] == {}


def test_connector_check_accounts_for_aborted_and_readmitted_loads() -> None:
    check = connector_check({"external_hit_tokens": 900, "range_loaded_tokens": 700, "range_failed_tokens": 100,
                             "range_aborted_tokens": 128, "range_preempted_load_tokens": 28})
    assert check["difference_tokens"] == 0 and check["agrees"]
    assert connector_check({"external_hit_tokens": 10})["difference_tokens"] == 10


def test_report_rows_show_the_check_and_both_ttfts() -> None:
    from range_connector.bench.replay import ReplayReport, RequestResult, summarize
    from range_connector.bench.replay_metrics import COUNTERS, EngineCounts
    from range_connector.bench.replay_report import check_cell, comparison_rows

    totals = dict.fromkeys(COUNTERS, 0.0)
    totals.update(prompt_tokens=1000, external_hit_tokens=600, range_loaded_tokens=500, range_failed_tokens=64,
                  engine_ttft_count=3, engine_ttft_sum_s=0.9)
    engine = EngineCounts(totals, {"u": totals}, {}, {"count": 3, "mean": 0.3, "p50": 0.25, "p90": 0.5, "p99": 0.7},
                          0.6, 0.0, range_engines=("u",))
    results = [RequestResult(i, 0.0, sent_s=0.0, dispatch_delay_s=0.0, ttft_s=0.3 + 0.1 * i, e2e_s=1.0,
                             prompt_tokens=10, output_tokens=2) for i in range(3)]
    rows = {row[0]: row[1:] for row in comparison_rows([ReplayReport("range", None, {}, summarize(results), engine,
                                                                     results)])}
    assert rows["TTFT p50 (s)"] == ["0.400"] and rows["  engine's histogram p50 (s)"] == ["0.250"]
    assert rows["  engine's histogram p99 (s)"] == ["0.700"]
    assert rows["  loaded and verified (Range)"] == ["500"] and rows["  failed, recomputed (Range)"] == ["64"]
    assert rows["  hits == loaded + failed"] == ["NO (hits - accounted: +36)"]
    assert rows["share served from the tier"] == ["50.0%"]
    assert rows["share admitted from the tier (vLLM)"] == ["60.0%"]
    assert check_cell(None) == "-"
    assert check_cell(connector_check({"external_hit_tokens": 100, "range_loaded_tokens": 50,
                                       "range_aborted_tokens": 50})) == "yes (50 aborted)"
