"""Load modes: layer-pipelined, asynchronous and synchronous loads, their deadlines, and in-flight safety.

Driven through the scheduler/worker harness of ``scheduler_worker_harness.py`` (which mirrors the hook order of the
installed vLLM), with the real ``RangeScheduler`` and ``RangeWorker`` and in-memory stripe stores behind the
``FlakyBackend`` wrapper (delays and hangs at the backend boundary). Where it matters, each test runs on the bank
path and on direct receive (the rows land straight in the KV cache: the wrapper lets loads scatter).

No test here times the code under test: a slow or frozen tier is *held* (it answers when the test says), the deadline
a load was given is read off the load job, background work is waited for with a wide bound, and probes are timed on
a virtual clock (the harness's module docstring says how).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.unit.clocks import (
    WIDE_S,
    StillClock,
    in_background,
    instant_probes,
    probe_timings_once_back,
    reads_returned,
    record_load_jobs,
    wait_until,
)
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    LAYER_BLOCK_BYTES,
    LAYERS,
    PATH_CONFIG,
    Engine,
    FakeRequest,
    changed_blocks,
    live_leases,
    produce,
    prompt_tokens,
    same_block,
    shard_backends,
    snapshot,
    wrap,
)

#: one layer per transfer bank, two banks taking turns: a pipelined load is delivered layer by layer
LAYER_BANKS = {"bank_bytes": 1, "num_banks": 2}


def _layer_equal(dst: dict[str, torch.Tensor], dst_block: int, src: dict[str, torch.Tensor], src_block: int,
                 layer: str) -> bool:
    d, s = dst[layer], src[layer]
    if d.dim() == 5:
        return torch.equal(d[:, dst_block], s[:, src_block])
    return torch.equal(d[dst_block], s[src_block])


def _settled(b: Engine, backends, timeout_s: float = WIDE_S) -> bool:
    """No lease (ours or the tier's) and no transfer bank left in use, once fills already in flight have ended."""
    end = time.monotonic() + timeout_s
    while True:
        if b.sched.num_leases == 0 and live_leases(backends) == 0 and b.worker.banks.in_use == 0:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def _run_until_loaded(b: Engine, req_id: str, timeout_s: float = WIDE_S):
    """Engine steps (other requests keep running) until the worker reports the asynchronous load of ``req_id``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        res = b.step()
        if req_id in res.finished_recving:
            return res
        time.sleep(0.01)
    raise AssertionError(f"the asynchronous load of {req_id} was never reported")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["layer-banks", "direct"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_pipelined_wait_for_layer_delivers_that_layer_before_the_last_one_lands(num_shards: int, path: str) -> None:
    inner = shard_backends(num_shards, num_shards)
    prompt = prompt_tokens(150, seed=51)
    a, a_blocks = produce(inner, prompt, num_shards=num_shards)
    flaky = wrap(inner, path)
    for f in flaky:
        f.read_delay_s = 0.05  # every layer group's read takes >= 50 ms per shard
    b = Engine(flaky, num_shards=num_shards, seed=52, **LAYER_BANKS)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    meta = b.sched.build_connector_meta(b._scheduler_output())
    before = snapshot(b.kv)
    b.worker.start_load(meta)
    assert changed_blocks(before, b.kv) == set()  # start_load returned with nothing delivered yet
    dst = b.running["B-0"].block_ids
    b.worker.wait_for_layer(LAYERS[0])
    layer0_returned_s = time.monotonic()
    for i in range(128 // BLOCK):
        assert _layer_equal(b.kv, dst[i], a.kv, a_blocks[i], LAYERS[0])
        assert _layer_equal(b.kv, dst[i], before, dst[i], LAYERS[-1])  # the last layer is not there yet
    for name in LAYERS[1:]:
        b.worker.wait_for_layer(name)
    b.worker.save(meta)
    assert b.worker.take_failed_block_ids() == set()
    [timeline] = b.worker.load_timelines
    assert timeline["mode"] == "pipelined" and timeline["num_groups"] == len(LAYERS)
    # From the recorded timestamps: layer 0 was handed to attention before the last layer's bytes had landed.
    assert layer0_returned_s < timeline["layer_ready_s"][-1]
    assert timeline["layer_waited_s"] == sorted(timeline["layer_waited_s"])
    for i in range(128 // BLOCK):
        assert same_block(b.kv, dst[i], a.kv, a_blocks[i])
    assert b.worker.banks.in_use == 0
    assert b.worker.stats["copy_launches"] == (0 if path == "direct" else len(LAYERS))
    a.close()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_layers_attention_did_not_wait_for_are_reported_not_trusted(mode: str) -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=53)
    a, a_blocks = produce(inner, prompt)
    b = Engine(wrap(inner), seed=54, load_mode=mode, **LAYER_BANKS)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    dst = list(b.running["B-0"].block_ids)
    res = b.step(layer_waits=False)  # a platform whose attention skips the connector's per-layer hooks
    if mode == "sync":  # delivered before the forward: nothing was read early
        assert res.invalid_block_ids == set()
        assert b.worker.stats["layers_read_before_load"] == 0
    else:  # attention ran on layers that had not landed: the whole load is recomputed
        assert res.invalid_block_ids == set(dst[:8])
        assert b.worker.stats["layers_read_before_load"] == len(LAYERS)
    assert _settled(b, inner)
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_async_load_does_not_delay_the_other_requests_of_the_batch() -> None:
    inner = shard_backends(2, 2)
    prompt = prompt_tokens(150, seed=55)
    a, a_blocks = produce(inner, prompt, num_shards=2)
    flaky = wrap(inner)
    # (a deadline floor of WIDE_S lets this held load land whenever the test releases it; with the cost model's
    # deadline alone it would be cut at what recomputing 128 tokens costs:
    # test_a_slow_tier_holds_a_load_no_longer_than_recomputing_would_take)
    b = Engine(flaky, num_shards=2, seed=56, load_mode="async", min_load_deadline_s=WIDE_S)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("C-0", prompt_tokens(40, seed=57))) == 0  # another request, computing
    b.step()
    for f in flaky:
        f.hold_reads()  # a slow tier: B's KV arrives only once the test lets it
    assert b.admit_async(FakeRequest("B-0", prompt)) == 128
    for _ in range(2):
        b.continue_("C-0", 1)  # C keeps decoding while B's KV is on its way ...
        res = b.step()  # ... and these steps come back with B's reads still held: they did not wait for B's load
        assert "B-0" not in res.finished_recving and b.worker.num_loads_in_flight == 1
    for f in flaky:
        f.release_reads()
    end = time.monotonic() + WIDE_S
    while "B-0" not in res.finished_recving:
        assert time.monotonic() < end, "the asynchronous load was never reported"
        b.continue_("C-0", 1)
        res = b.step()
        time.sleep(0.01)
    assert res.invalid_block_ids == set()
    assert b.resume_after_load("B-0", res.invalid_block_ids) == 128
    dst = list(b.running["B-0"].block_ids)
    for i in range(8):
        assert same_block(b.kv, dst[i], a.kv, a_blocks[i])
    b.step()  # B computes its last tokens on top of the loaded prefix
    assert _settled(b, inner)
    a.close()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["bank", "layer-banks", "direct"])
def test_case_C11_abort_during_async_load_frees_everything_and_writes_nothing_after(path: str) -> None:
    # direct: the delayed read then tries to land in the freed blocks; the job's gate refuses it.
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=58)
    a, a_blocks = produce(inner, prompt)
    flaky = wrap(inner, path)
    b = Engine(flaky, seed=59, load_mode="async", **PATH_CONFIG[path])  # type: ignore[arg-type]
    for f in flaky:
        f.hold_reads()  # the tier answers only once the test lets it
    assert b.admit_async(FakeRequest("B-0", prompt)) == 128
    res = b.step()
    assert not res.finished_recving
    wait_until(lambda: sum(f.loads_in_flight for f in flaky) >= 1, "B's read reached the tier")
    b.abort_waiting("B-0")  # the client disconnects while the load is in flight
    res = b.step()
    assert res.finished_recving == {"B-0"}  # reported at once, so vLLM frees the blocks
    assert b.worker.stats["loads_aborted"] == 1
    freed = snapshot(b.kv)
    for f in flaky:
        f.release_reads()  # the read that was in flight completes: nothing of it may reach the freed blocks
    reads_returned(b, flaky)
    assert changed_blocks(freed, b.kv) == set()
    res = b.step()  # a late completion is not reported twice, and the engine keeps serving
    assert res.finished_recving == set()
    assert _settled(b, inner)
    assert b.admit_async(FakeRequest("B-1", prompt)) == 128
    res = _run_until_loaded(b, "B-1")
    assert res.invalid_block_ids == set()
    b.resume_after_load("B-1")
    new_dst = b.running["B-1"].block_ids
    assert all(same_block(b.kv, new_dst[i], a.kv, a_blocks[i]) for i in range(8))
    a.close()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["bank", "direct"])
@pytest.mark.parametrize("mode", ["async", "pipelined"])
def test_case_C21_frozen_tier_gives_up_at_the_deadline_and_the_prompt_is_recomputed(mode: str, path: str,
                                                                                      monkeypatch) -> None:
    deadline_s = 0.2
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=60)
    a, _ = produce(inner, prompt)
    flaky = wrap(inner, path)
    b = Engine(flaky, seed=61, load_mode=mode, load_deadline_s=deadline_s,  # type: ignore[arg-type]
               backend_timeout_s=WIDE_S)
    for f in flaky:
        f.hold_reads()  # frozen: the tier answers nothing until the test releases it, then a timeout error
        f.read_hang_s = 0.0
    jobs = record_load_jobs(monkeypatch)
    before = time.monotonic()
    if mode == "async":
        assert b.admit_async(FakeRequest("B-0", prompt)) == 128
        dst = list(b.waiting_for_kv["B-0"].block_ids)
        res = _run_until_loaded(b, "B-0")
    else:
        assert b.admit(FakeRequest("B-0", prompt)) == 128
        dst = list(b.running["B-0"].block_ids)
        res = b.step(forward=False)
    # The load was given load_deadline_s from its start, and gave up there by itself: the tier never answered it.
    [(job, started)] = jobs
    assert before + deadline_s <= job.deadline_at_start_s <= started + deadline_s
    assert res.invalid_block_ids == set(dst[:8])
    assert b.worker.stats["load_deadline_misses"] >= 1
    if mode == "async":
        assert b.resume_after_load("B-0", res.invalid_block_ids) == 0  # recomputed from the start
        b.step()
    for f in flaky:
        f.release_reads()
    reads_returned(b, flaky)
    assert _settled(b, inner)
    a.close()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "pipelined"])
def test_a_slow_tier_holds_a_load_no_longer_than_recomputing_would_take(mode: str, monkeypatch) -> None:
    # No gate decides here (the mode is fixed), but the cost model's estimators still bound the load: its deadline is
    # twice the expected load, at most the predicted recompute (load_deadline_s is left at 30 s). Checked as what the
    # code decided: the plan's deadline, the deadline the worker gave the load job, and that the job ended there on its
    # own (failed, a deadline miss) while the tier, now very slow, had not answered at all.
    from range_connector.cost.estimators import RateEstimator
    from range_connector.cost.model import PrefillRate

    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=64)
    a, _ = produce(inner, prompt)
    slow = wrap(inner)
    # (a tier call deadline far past the hold: the engine's backstop for an asynchronous load that overran its own
    # deadline, deadline + timeout_s, cannot be what ends this one)
    b = Engine(slow, seed=65, load_mode=mode, min_load_deadline_s=0.05,  # type: ignore[arg-type]
               backend_timeout_s=WIDE_S)
    recompute_s = 0.4
    b.sched.gate.rates = RateEstimator(PrefillRate.constant(128 / recompute_s))  # 128 tokens take 0.4 s to prefill
    # The tier was measured slowish (0.3 s per MiB: this load predicted at 0.27 s, so it is started; a tier predicted
    # slower than the deadline is not loaded at all, see the next test); then it turns much slower: it answers only
    # once the test lets it, after the load is over.
    b.sched.gate.tiers.observe("memory", 0, 1 << 20, 0.3)
    for f in slow:
        f.hold_reads()
    jobs = record_load_jobs(monkeypatch)
    before = time.monotonic()
    if mode == "async":
        assert b.admit_async(FakeRequest("B-0", prompt)) == 128
        dst = list(b.waiting_for_kv["B-0"].block_ids)
    else:
        assert b.admit(FakeRequest("B-0", prompt)) == 128
        dst = list(b.running["B-0"].block_ids)
    (planned,) = b.sched._loads
    assert planned.deadline_s == pytest.approx(recompute_s, rel=0.01)  # 2 x expected is far longer: recompute wins
    res = _run_until_loaded(b, "B-0") if mode == "async" else b.step(forward=False)
    # The worker gave the load job the plan's deadline, counted from the load's start (not load_deadline_s) ...
    [(job, started)] = jobs
    assert before + planned.deadline_s <= job.deadline_at_start_s <= started + planned.deadline_s
    # ... and the job gave up there by itself: every block failed, counted as a deadline miss, the tier still held.
    assert res.invalid_block_ids == set(dst[:8])
    assert b.worker.stats["load_deadline_misses"] >= 1
    assert job.deadline_missed
    for f in slow:
        f.release_reads()  # the hung reads return; their leases and banks come back
    reads_returned(b, slow)
    assert _settled(b, inner)
    a.close()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "pipelined"])
def test_a_load_predicted_to_miss_its_deadline_is_not_started_and_the_tier_is_probed_instead(mode: str,
                                                                                              monkeypatch) -> None:
    # The estimators believe the tier delivers 1 kB/s (clamped to 100 kB/s): loading the hit would take longer than its
    # deadline (bounded by the 0.4 s that recomputing it costs), so starting it could only make the request wait 0.4 s
    # and then recompute. The hit is not offered; one of its chunks is read in the background instead, and the tier, in
    # fact fast, is offered again once that timing is back. No request waited, nothing was written into the KV cache.
    # (The probe is timed on a virtual clock: what the gate learns from it does not depend on this machine's load.)
    from range_connector.cost.estimators import RateEstimator
    from range_connector.cost.gate import CostGate, GateConfig
    from range_connector.cost.model import PrefillRate

    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=66)
    a, _ = produce(inner, prompt)
    flaky = wrap(inner)
    instant_probes(monkeypatch)
    b = Engine(flaky, seed=67, load_mode=mode, min_load_deadline_s=0.05)  # type: ignore[arg-type]
    assert b.sched.gate is not None
    b.sched.gate = CostGate("memory", 1, b.sched.gate.bytes_per_token, len(LAYERS), BLOCK, b.chunk_tokens,
                            config=GateConfig(seed_bandwidth_bytes_per_s=1e3, probe_interval_s=0.0,
                                              probe_every_refusals=1))
    b.sched.gate.rates = RateEstimator(PrefillRate.constant(128 / 0.4))
    load_s, recompute_s = b.sched.gate.predict_s(0, 128)
    assert load_s > recompute_s == pytest.approx(0.4)
    (f,) = flaky
    f.hold_reads()
    assert b.admit(FakeRequest("B-0", prompt)) == 0  # not offered
    res = b.step(snapshots=True)
    assert res.meta.loads == [] and len(res.meta.probes) == 1
    assert b.sched.stats["loads_not_started_late"] == 1 and b.sched.stats["late_load_probes"] == 1
    # The step came back before the probe's read was answered: the probe runs in the background.
    wait_until(lambda: f.loads_in_flight == 1, "the probe's read reached the tier")
    f.release_reads()
    wait_until(lambda: b.worker.stats["probes"] == 1, "the probe ended")
    assert f.calls["read_ranges"] == 1  # the probe's one batched read
    assert changed_blocks(res.before, res.after_load) == set()
    b.finish("B-0")
    assert len(probe_timings_once_back(b, res)) == 1
    ext, _ = b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0)
    assert ext == 128  # the probe measured a fast tier: the hit is offered again
    assert b.sched.stats["loads_not_started_late"] == 1
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_case_C10_preempted_request_blocks_reused_never_put_foreign_kv_in_a_stored_entry() -> None:
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=62)
    a = Engine(inner, seed=63)
    assert a.admit(FakeRequest("A-0", prompt), 70) == 0
    a.step()  # saves the chunks completed in this step (inside wait_for_save, from blocks A-0 owns)
    a_blocks = list(a.running["A-0"].block_ids)
    saved_kv = snapshot(a.kv)
    a.preempt("A-0")  # blocks go back to the pool ...
    a.free = a_blocks + [x for x in a.free if x not in a_blocks]
    assert a.admit(FakeRequest("X-0", prompt_tokens(150, seed=64))) == 0  # ... and another request reuses them
    a.step()
    assert changed_blocks(saved_kv, a.kv) & set(a_blocks)  # the blocks now hold the other request's KV
    # The first prompt again, in a fresh engine: what it loads is A-0's KV, not X-0's.
    b = Engine(wrap(inner), seed=65)
    ext = b.admit(FakeRequest("B-0", prompt))
    assert ext == 64  # the two chunks that A-0 completed before it was preempted
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    dst = b.running["B-0"].block_ids
    assert all(same_block(res.after_load, dst[i], saved_kv, a_blocks[i]) for i in range(ext // BLOCK))
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------------- the cost gate
@pytest.mark.timeout(60)
def test_auto_mode_takes_a_hit_on_a_fast_tier_refuses_it_on_a_slow_one_and_learns_from_loads() -> None:
    from range_connector.cost.gate import CostGate, GateConfig

    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=80)
    a, a_blocks = produce(inner, prompt)
    b = Engine(wrap(inner), seed=81, load_mode="auto")  # type: ignore[arg-type]
    assert b.sched.gate is not None
    before = b.sched.gate.tiers.estimate("memory", 0)
    assert b.admit(FakeRequest("B-0", prompt)) == 128  # seeds: a fast tier, slow prefill: taken
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    assert res.worker_meta is not None and res.worker_meta.load_timings  # the worker reported the load's time
    after = b.sched.gate.tiers.estimate("memory", 0)
    assert after != before  # ... and the gate learnt B and T0 from it
    assert b.sched.gate.stats.snapshot()["decisions_taken"] == 1 and b.sched.gate.stats.snapshot()["realised_loads"] == 1
    # The same tier believed to deliver 1 kB/s: recomputing is faster, the hit is refused (nothing promised).
    slow = CostGate("memory", 1, b.sched.gate.bytes_per_token, len(LAYERS), BLOCK, b.chunk_tokens,
                    config=GateConfig(seed_bandwidth_bytes_per_s=1e3, probe_interval_s=1e9))
    b.sched.gate = slow
    # The first lookup may be a probe (one chunk, to re-measure the tier); within the probe interval, none.
    probe = b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0)
    assert probe[0] in (0, b.chunk_tokens)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-2", prompt), 0) == (0, False)
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_a_refused_tier_is_probed_in_the_background_and_taken_again_once_fast(monkeypatch) -> None:
    # The gate believes the tier delivers 1 kB/s (clamped to 100 kB/s; recomputing the hit: 0.26 s): it refuses, and
    # instead of making the request load a chunk to re-measure it, the worker reads one stored chunk in the background;
    # the tier is in fact fast, so the probe's timing brings the hit back. No request waited for the probe (the step
    # comes back while the probe's reads are held), and nothing was written into the KV cache. The probe is timed on a
    # virtual clock (0.1 ms): whether its timing brings the hit back does not depend on how busy this machine is.
    from range_connector.cost.gate import CostGate, GateConfig

    inner = shard_backends(2, 2)
    prompt = prompt_tokens(150, seed=84)
    a, _ = produce(inner, prompt, num_shards=2)
    flaky = wrap(inner)
    instant_probes(monkeypatch)
    b = Engine(flaky, num_shards=2, seed=85, load_mode="auto")  # type: ignore[arg-type]
    assert b.sched.gate is not None
    b.sched.gate = CostGate("memory", 2, b.sched.gate.bytes_per_token, len(LAYERS), BLOCK, b.chunk_tokens,
                            config=GateConfig(seed_bandwidth_bytes_per_s=1e3, seed_tokens_per_s=500.0,
                                              probe_interval_s=0.0, probe_every_refusals=1))
    req = FakeRequest("B-0", prompt)
    for f in flaky:
        f.hold_reads()
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # refused (the probe is queued)
    assert b.admit(req) == 0
    res = b.step(snapshots=True)
    assert res.meta.probes and len(res.meta.probes[0]) == 2 and res.meta.loads == []
    # The step came back with the probe's reads (one per shard, at the same time) still held: in the background.
    wait_until(lambda: [f.loads_in_flight for f in flaky] == [1, 1], "the probe's reads reached both shards")
    assert b.worker.stats["probes"] == 0
    for f in flaky:
        f.release_reads()
    wait_until(lambda: b.worker.stats["probes"] == 1, "the probe ended")
    assert [f.calls["read_ranges"] for f in flaky] == [1, 1]  # one batched read per shard
    assert changed_blocks(res.before, res.after_load) == set()  # the probe wrote nothing into the KV cache
    b.finish("B-0")
    timings = probe_timings_once_back(b, res)
    assert len(timings) == 1
    per_shard, seconds, complete = timings[0]
    assert complete and per_shard == b.chunk_tokens // BLOCK // 2 * LAYER_BLOCK_BYTES["dense"] * len(LAYERS)
    assert b.sched.gate.stats.snapshot()["decisions_probes"] == 1
    ext, _ = b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0)
    assert ext == 128  # the probe showed a fast tier: the hit is taken again
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_a_tier_that_cannot_pay_for_any_hit_is_neither_looked_up_nor_written_between_probes() -> None:
    # The gate believes the tier delivers 1 kB/s: even a whole-prompt hit would lose to recomputing. Between probes a
    # request costs the tier nothing: no lookup, no save (counted from the backend's own call counters).
    from range_connector.cost.gate import CostGate, GateConfig

    flaky = wrap(shard_backends(1, 1))
    b = Engine(flaky, seed=87, load_mode="auto")  # type: ignore[arg-type]
    assert b.sched.gate is not None
    b.sched.gate = gate = CostGate("memory", 1, b.sched.gate.bytes_per_token, len(LAYERS), BLOCK, b.chunk_tokens,
                                   config=GateConfig(seed_bandwidth_bytes_per_s=1e3, probe_interval_s=0.0,
                                                     probe_every_refusals=3))
    assert gate.tiers.should_probe("memory", time.monotonic())  # a probe just went out: the next is 3 refusals away
    (f,) = flaky
    lookups, writes = f.calls["get_tickets"], f.calls["write_stripe"]
    for i in (1, 2):  # the next two are neither looked up nor saved
        assert b.admit(FakeRequest(f"N-{i}", prompt_tokens(150, seed=90 + i))) == 0
        b.step()
    assert b.worker.wait_for_saves(WIDE_S)
    assert (f.calls["get_tickets"], f.calls["write_stripe"]) == (lookups, writes)
    assert b.sched.stats["lookups_skipped_unprofitable"] == 2
    assert gate.stats.snapshot()["decisions_refused"] == 2  # still counted as refusals
    assert b.admit(FakeRequest("N-3", prompt_tokens(150, seed=93))) == 0  # a probe is due again: looked up
    b.step()
    assert b.worker.wait_for_saves(WIDE_S)
    assert f.calls["get_tickets"] > lookups and f.calls["write_stripe"] > writes
    b.close()


# ---------------------------------------------------------------------------------------------- slow tier, engine steps
def _slow(backends, *, delay_s: float = 0.0, write_bandwidth: float = 0.0, frozen: bool = False):
    from range_connector.backends.latency import LatencyBackend, LatencyControl, TierLatency

    clock = StillClock()
    control = LatencyControl(TierLatency(delay_s=delay_s, bandwidth_bytes_per_s=write_bandwidth, frozen=frozen),
                             clock=clock)
    return [LatencyBackend(b, control, timeout_s=5.0, sleep=lambda s: None) for b in backends], control, clock


@pytest.mark.timeout(60)
def test_async_saves_do_not_hold_the_step_and_are_reported_once_written() -> None:
    # The tier stops answering (frozen, on a clock that never reaches the calls' deadline): a synchronous save holds
    # the step until the tier answers again; an asynchronous one copies the blocks out and the step returns while the
    # write still waits; the chunks are stored and reported once written.
    prompt = prompt_tokens(150, seed=86)
    for mode in ("sync", "async"):
        inner = shard_backends(1, 1)
        slow, control, clock = _slow(inner)
        eng = Engine(slow, seed=87, save_mode=mode)
        assert eng.admit(FakeRequest(f"{mode}-0", prompt)) == 0
        control.update(frozen=True)
        readings = clock.readings
        stepper, out = in_background(eng.step)
        # The step's save reached the tier and waits there (it reads the clock while it waits), nothing written yet.
        wait_until(lambda: clock.readings >= readings + 3, "the save reached the frozen tier")
        assert inner[0].used_bytes() == 0
        if mode == "sync":
            assert stepper.is_alive() and out == []  # the step is held by its save
            control.update(frozen=False)
            stepper.join(WIDE_S)
            assert not stepper.is_alive()
            [res] = out
            assert res.worker_meta is not None and len(res.worker_meta.saved) == 4
        else:
            stepper.join(WIDE_S)  # the step comes back while its save still waits for the tier
            assert not stepper.is_alive() and inner[0].used_bytes() == 0
            [res] = out
            assert res.worker_meta is None or not res.worker_meta.saved  # not written yet
            control.update(frozen=False)
            assert eng.worker.wait_for_saves(WIDE_S)
            eng.finish(f"{mode}-0")
            res2 = eng.step(forward=False)
            assert res2.worker_meta is not None and len(res2.worker_meta.saved) == 4
        assert inner[0].used_bytes() > 0
        eng.close()
    # Another engine finds the chunks written in the background.
    b = Engine(inner, seed=88)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (128, False)
    b.close()


@pytest.mark.timeout(60)
def test_async_saves_past_the_backlog_are_skipped_and_counted_but_an_empty_backlog_takes_one() -> None:
    # The bound is less than one stripe. The first step's save finds the backlog empty and is taken (a bound smaller
    # than one step's save must not skip every save); while it waits on a frozen tier, the next step's save (the same
    # request's next prefill chunk) is skipped and counted.
    inner = shard_backends(1, 1)
    slow, control, clock = _slow(inner)
    eng = Engine(slow, seed=89, save_mode="async", save_backlog_bytes=1024)
    assert eng.admit(FakeRequest("A-0", prompt_tokens(150, seed=90)), 64) == 0
    control.update(frozen=True)
    readings = clock.readings
    eng.step()
    wait_until(lambda: clock.readings >= readings + 3, "the first save reached the frozen tier")
    assert eng.worker.saver.backlog_bytes > 1024 and eng.worker.stats.get("saves_skipped_backlog", 0) == 0
    eng.continue_("A-0", 64)
    eng.step()
    assert eng.worker.stats["saves_skipped_backlog"] == 1
    control.update(frozen=False)
    assert eng.worker.wait_for_saves(WIDE_S) and eng.worker.saver.backlog_bytes == 0
    assert inner[0].used_bytes() > 0  # the first one was written
    eng.close()


@pytest.mark.timeout(60)
def test_a_slow_lookup_lets_the_engine_run_other_requests() -> None:
    # The tier does not answer (frozen, on a clock that never reaches the call's deadline) until the test says; with
    # lookup_wait_s 0 the scheduler does not wait: the request is asked again later (vLLM's None), its lookup still
    # running, and gets its hit once the lookup is back.
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=91)
    a, _ = produce(inner, prompt)
    slow, control, _ = _slow(inner, frozen=True)
    b = Engine(slow, seed=92, lookup_wait_s=0.0)
    req = FakeRequest("B-0", prompt)
    asker, out = in_background(lambda: b.sched.get_num_new_matched_tokens(req, 0))
    asker.join(WIDE_S)  # did not wait for the tier, which has not answered
    assert not asker.is_alive() and out == [(None, False)]
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # asked again: still running
    control.update(frozen=False)
    answers = []
    end = time.monotonic() + WIDE_S
    while not answers or answers[-1] == (None, False):
        assert time.monotonic() < end, "the lookup never came back"
        answers.append(b.sched.get_num_new_matched_tokens(req, 0))
        time.sleep(0.005)
    assert answers[-1] == (128, False)
    assert b.sched.stats["lookups_pending"] == 2 + len(answers) - 1  # every "not yet", none for the hit
    assert b.sched.stats["lookups"] == 1  # one lookup, answered once
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_bank_pool_reuses_buffers_of_different_sizes_without_comparing_tensors() -> None:
    """Banks of several sizes in the free list (several asynchronous loads at once): taking one that is not first
    in the list must not compare tensors elementwise (list.remove would), and no slot may leak."""
    from range_connector.worker.banks import BankPool

    pool = BankPool(3)
    banks = [pool.acquire(n, 1.0) for n in (1 << 20, 1 << 19, 1 << 18)]
    for b in banks:
        pool.release(b)
    for _ in range(5):
        got = [pool.acquire(n, 1.0) for n in (1 << 18, 1 << 19, 1 << 20)]
        assert [g.buffer.numel() for g in got] == [1 << 18, 1 << 19, 1 << 20]
        for g in got:
            pool.release(g)
    assert pool.in_use == 0 and pool.allocations == 3


@pytest.mark.timeout(60)
def test_auto_mode_learns_the_prefill_rate_only_from_steps_with_work_left_after_them() -> None:
    # A step's interval (to the next plan) is step time only while requests remain; once every request of a step
    # finished, the engine may idle until the next request arrives, and that gap would make R look far too slow.
    from types import SimpleNamespace

    b = Engine(wrap(shard_backends(1, 1)), seed=82, load_mode="auto")  # type: ignore[arg-type]
    rates = b.sched.gate.rates

    def plan(req_id: str, finished: tuple[str, ...] = ()) -> None:
        cached = SimpleNamespace(req_ids=[req_id], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[0])
        b.sched.build_connector_meta(SimpleNamespace(
            total_num_scheduled_tokens=512, finished_req_ids=set(finished), scheduled_new_reqs=[],
            scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: 512}))
        time.sleep(0.02)

    plan("r1")
    plan("r1")  # r1 still running: the interval was a step
    assert rates.num_samples == 1
    plan("r2", finished=("r1",))  # the previous step's only request finished: maybe idle, not learnt
    assert rates.num_samples == 1
    plan("r2")
    assert rates.num_samples == 2
    b.close()
