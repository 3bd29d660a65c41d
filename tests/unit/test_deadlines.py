"""Load deadlines: a load past its deadline is reported failed and returns in time, is not offered again, starts no
read after the deadline, and a frozen shard costs one timeout per load.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`), with slow answers and frozen
tiers injected by ``FlakyBackend``. Nothing is timed: a slow or frozen tier is held until the test releases it (so
the load can only end through its own deadline), the deadline a load was given is read off its job, the reads the
tier got are counted (with when each started), and probes are timed on a virtual clock.
"""

from __future__ import annotations

import time

import pytest

from tests.unit.clocks import (
    WIDE_S,
    in_background,
    instant_probes,
    probe_timings_once_back,
    reads_returned,
    record_load_jobs,
    wait_until,
)
from tests.unit.scheduler_worker_harness import (
    PATH_CONFIG,
    Engine,
    FakeRequest,
    changed_blocks,
    live_leases,
    produce,
    prompt_tokens,
    same_block,
    shard_backends,
    wrap,
)


# ---------------------------------------------------------------------------------------------------- deadline
def reprobe(eng: Engine, prompt: list[int], req_id: str = "probe") -> None:
    """After a load ran out of time the estimators hold a censored (at-least-this-slow) sample of the tier: the next
    hit is predicted to miss its deadline and is not started (``loads_not_started_late``); one of its chunks is read
    in the background instead. Run that request (recomputed) until the probe's timing is back, so the next request
    is offered the hit again. (Probes must be timed on a virtual clock, :func:`instant_probes`: that the next request
    is offered the hit must not depend on how long the probe took on this machine.)"""
    late = eng.sched.stats["loads_not_started_late"]
    assert eng.admit(FakeRequest(req_id, prompt)) == 0
    assert eng.sched.stats["loads_not_started_late"] == late + 1
    res = eng.step()
    wait_until(lambda: eng.worker.stats["probes"] >= 1, "the probe ended")
    eng.finish(req_id)
    probe_timings_once_back(eng, res)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["slow-answer", "frozen-tier"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_load_past_its_deadline_is_reported_failed_and_returns_in_time(mode: str, num_shards: int,
                                                                       monkeypatch) -> None:
    deadline_s = 0.1
    instant_probes(monkeypatch)
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner)
    kw = dict(num_shards=num_shards)
    p0, p1 = prompt_tokens(150, seed=32), prompt_tokens(100, seed=33)
    a, a_blocks = produce(inner, p0, **kw)
    a2, _ = produce(inner, p1, req_id="A-1", **kw)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=WIDE_S, seed=10,  # type: ignore[arg-type]
               **kw)
    assert b.admit(FakeRequest("B-0", p0)) == 128
    assert b.admit(FakeRequest("B-1", p1)) == 96
    for f in flaky:
        f.hold_reads()  # the tier answers only after the load is over: with the data (slow) or a timeout (frozen)
        if mode == "frozen-tier":
            f.read_hang_s = 0.0
    jobs = record_load_jobs(monkeypatch)
    before = time.monotonic()
    res = b.step(forward=False)

    # The step's load (both requests) was given load_deadline_s and gave up there by itself, the tier not having
    # answered; no shard was asked twice.
    [(job, started)] = jobs
    assert before + deadline_s <= job.deadline_at_start_s <= started + deadline_s and job.deadline_missed
    expected = set(b.running["B-0"].block_ids[:8]) | set(b.running["B-1"].block_ids[:6])
    assert res.invalid_block_ids == expected
    assert changed_blocks(res.before, res.after_load) == set()
    assert b.worker.stats["load_deadline_misses"] == 1
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    # Reads still in flight when the load gave up never reach the KV cache, and once the tier answers again the
    # next load works (the abandoned transfer banks came back).
    for f in flaky:
        f.release_reads()
    reads_returned(b, flaky)
    assert changed_blocks(res.before, b.kv) == set()
    assert all(f.calls["read_ranges"] <= 1 for f in flaky)
    for f in flaky:
        f.read_hang_s = None
    b.finish("B-0")
    reprobe(b, p0)
    assert b.admit(FakeRequest("B-2", p0)) == 128
    res2 = b.step(forward=False)
    assert res2.invalid_block_ids == set()
    b2_blocks = b.running["B-2"].block_ids
    assert all(same_block(res2.after_load, b2_blocks[i], a.kv, a_blocks[i]) for i in range(8))
    a.close()
    a2.close()
    b.close()


@pytest.mark.timeout(30)
def test_load_that_ran_out_of_time_is_neither_offered_again_nor_saved_twice(monkeypatch) -> None:
    # vLLM reschedules a request whose load failed (an asynchronous one through the waiting queue, where the
    # connector is asked again): offering it the same slow hit again loops until the client gives up. Its stored
    # chunks are still stored (only the load was late): recomputing them must not write them a second time.
    deadline_s = 0.1
    instant_probes(monkeypatch)
    inner = shard_backends(1, 1)
    flaky = wrap(inner)
    prompt = prompt_tokens(150, seed=39)
    a, _ = produce(inner, prompt)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=WIDE_S, seed=15)  # type: ignore[arg-type]
    req = FakeRequest("B-0", prompt)
    assert b.admit(req) == 128
    flaky[0].hold_reads()  # the tier answers only after the load is over
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    # The worker tells the gate how long the tier took at least (a censored sample: the planned bytes).
    assert res.worker_meta is not None
    [(req_ids, shard_bytes, seconds, complete)] = res.worker_meta.load_timings
    assert req_ids == ("B-0",) and not complete and seconds >= deadline_s and shard_bytes > 0
    flaky[0].release_reads()
    reads_returned(b, flaky)
    b.preempt("B-0")  # rescheduled: looked up again
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert b.sched.stats["reoffers_refused"] == 1
    writes_before = flaky[0].calls["write_stripe"]
    assert b.admit(req) == 0
    res2 = b.step()  # the whole prompt is recomputed; its 4 stored chunks are not saved again
    assert res2.meta.saves == [] and flaky[0].calls["write_stripe"] == writes_before
    # Another request for the same prompt is offered the stored chunks (once a probe re-measured the tier).
    reprobe(b, prompt)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (128, False)
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_no_load_read_starts_after_the_deadline(monkeypatch) -> None:
    # The reader thread fills banks shard after shard with no deadline check: once the consumer has given up, the
    # frozen tier is still asked (one backend_timeout_s each), and the next step's fills queue behind those calls.
    # (The deadline is 2 s only so that both shards' reads surely start before it: the test waits for that.)
    deadline_s = 2.0
    inner = shard_backends(2, 2)
    flaky = wrap(inner)
    prompt = prompt_tokens(150, seed=37)
    a, _ = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, load_deadline_s=deadline_s, backend_timeout_s=WIDE_S,  # type: ignore[arg-type]
               seed=13)
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    for f in flaky:
        f.hold_reads()  # frozen: nothing answers until the test releases the tier, then a timeout error
        f.read_hang_s = 0.0
    jobs = record_load_jobs(monkeypatch)
    stepper, out = in_background(lambda: b.step(forward=False))
    # Both shards are asked at once (one call each, both held together: in parallel) ...
    wait_until(lambda: [f.loads_in_flight for f in flaky] == [1, 1], "both shards were asked")
    stepper.join(WIDE_S)
    assert not stepper.is_alive()
    [res] = out
    [(job, _started)] = jobs
    assert res.invalid_block_ids and job.deadline_missed
    for f in flaky:
        f.release_reads()
    reads_returned(b, flaky)  # let anything still queued run
    # ... before the deadline, and nothing after it.
    assert [f.calls["read_ranges"] for f in flaky] == [1, 1]
    assert all(t <= job.deadline for f in flaky for t in f.load_entered_s)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_a_frozen_shard_costs_one_timeout_per_load_not_one_per_layer_group() -> None:
    # DESIGN: a dead or frozen shard costs one timeout, not one per request (lookups and saves back off for
    # backend_retry_s). With one layer per bank the load below is 4 layer groups; the first one's read times out,
    # which fails every chunk, yet groups 2-4 are read from the frozen shard and waited for, one timeout each, up to
    # load_deadline_s (30 s by default): the step stalls for min(groups x backend_timeout_s, load_deadline_s).
    # (Checked by counting: the frozen shard's first read is held until the test lets it time out; the load's own
    # deadline is far away, so only that timeout can end the step; then the shard must not be asked again.)
    inner = shard_backends(1, 1)
    flaky = wrap(inner, "layer-banks")
    prompt = prompt_tokens(150, seed=38)
    a, _ = produce(inner, prompt)
    b = Engine(flaky, load_deadline_s=WIDE_S, backend_timeout_s=WIDE_S, seed=14,  # type: ignore[arg-type]
               **PATH_CONFIG["layer-banks"])
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    (f,) = flaky
    f.hold_reads()
    f.read_hang_s = 0.0  # released: the call times out, as a frozen server's does
    stepper, out = in_background(lambda: b.step(forward=False))
    wait_until(lambda: f.loads_in_flight == 1, "the first layer group's read reached the tier")
    f.release_reads()
    stepper.join(WIDE_S)
    assert not stepper.is_alive()
    [res] = out
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    reads_returned(b, flaky)  # let anything still queued run, so the count below is final
    assert f.calls["read_ranges"] == 1  # today: one per layer group, each waited for (4 timeouts per load)
    a.close()
    b.close()
