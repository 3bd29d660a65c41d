"""Load deadlines: a load past its deadline is reported failed and returns in time, is not offered again, starts no
read after the deadline, and a frozen shard costs one timeout per load.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`), with slow answers and frozen
tiers injected by ``FlakyBackend``.
"""

from __future__ import annotations

import time

import pytest

from tests.unit.scheduler_worker_harness import (
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
    wrap,
)


# ---------------------------------------------------------------------------------------------------- deadline
def reprobe(eng: Engine, prompt: list[int], req_id: str = "probe") -> None:
    """After a load ran out of time the estimators hold a censored (at-least-this-slow) sample of the tier: the next
    hit is predicted to miss its deadline and is not started (``loads_not_started_late``); one of its chunks is read
    in the background instead. Run that request (recomputed) until the probe's timing is back, so the next request
    is offered the hit again."""
    late = eng.sched.stats["loads_not_started_late"]
    assert eng.admit(FakeRequest(req_id, prompt)) == 0
    assert eng.sched.stats["loads_not_started_late"] == late + 1
    eng.step()
    deadline = time.monotonic() + 10
    while not eng.worker.stats["probes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.worker.stats["probes"] >= 1
    eng.finish(req_id)
    eng.step(forward=False)  # (the probe's timing comes back with the next step)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["slow-answer", "frozen-tier"])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_load_past_its_deadline_is_reported_failed_and_returns_in_time(mode: str, num_shards: int) -> None:
    deadline_s, backend_s = 0.1, 0.3
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner)
    kw = dict(num_shards=num_shards)
    p0, p1 = prompt_tokens(150, seed=32), prompt_tokens(100, seed=33)
    a, a_blocks = produce(inner, p0, **kw)
    a2, _ = produce(inner, p1, req_id="A-1", **kw)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=backend_s, seed=10,  # type: ignore[arg-type]
               **kw)
    assert b.admit(FakeRequest("B-0", p0)) == 128
    assert b.admit(FakeRequest("B-1", p1)) == 96
    for f in flaky:
        if mode == "slow-answer":
            f.read_delay_s = backend_s
        else:
            f.read_hang_s = backend_s
    res = b.step(forward=False)

    # At most one backend call past the deadline (a second call would take the time to >= 0.6 s).
    assert res.load_s < deadline_s + backend_s + 0.15
    expected = set(b.running["B-0"].block_ids[:8]) | set(b.running["B-1"].block_ids[:6])
    assert res.invalid_block_ids == expected
    assert changed_blocks(res.before, res.after_load) == set()
    assert b.worker.stats["load_deadline_misses"] == 1
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    # Reads still in flight when the load gave up never reach the KV cache, and once the tier answers again the
    # next load works (the abandoned transfer banks came back).
    time.sleep(backend_s * num_shards + 0.1)
    assert changed_blocks(res.before, b.kv) == set()
    for f in flaky:
        f.read_delay_s, f.read_hang_s = 0.0, None
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
def test_load_that_ran_out_of_time_is_neither_offered_again_nor_saved_twice() -> None:
    # vLLM reschedules a request whose load failed (an asynchronous one through the waiting queue, where the
    # connector is asked again): offering it the same slow hit again loops until the client gives up. Its stored
    # chunks are still stored (only the load was late): recomputing them must not write them a second time.
    deadline_s, backend_s = 0.1, 0.3
    inner = shard_backends(1, 1)
    flaky = wrap(inner)
    prompt = prompt_tokens(150, seed=39)
    a, _ = produce(inner, prompt)
    b = Engine(flaky, load_deadline_s=deadline_s, backend_timeout_s=backend_s, seed=15)  # type: ignore[arg-type]
    req = FakeRequest("B-0", prompt)
    assert b.admit(req) == 128
    flaky[0].read_delay_s = backend_s
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    # The worker tells the gate how long the tier took at least (a censored sample: the planned bytes).
    assert res.worker_meta is not None
    [(req_ids, shard_bytes, seconds, complete)] = res.worker_meta.load_timings
    assert req_ids == ("B-0",) and not complete and seconds >= deadline_s and shard_bytes > 0
    flaky[0].read_delay_s = 0.0
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


@pytest.mark.timeout(30)
def test_no_load_read_starts_after_the_deadline() -> None:
    # The reader thread fills banks shard after shard with no deadline check: once the consumer has given up, the
    # frozen tier is still asked (one backend_timeout_s each), and the next step's fills queue behind those calls.
    deadline_s, backend_s = 0.1, 0.3
    inner = shard_backends(2, 2)
    flaky = wrap(inner)
    prompt = prompt_tokens(150, seed=37)
    a, _ = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, load_deadline_s=deadline_s, backend_timeout_s=backend_s,  # type: ignore[arg-type]
               seed=13)
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    for f in flaky:
        f.read_hang_s = backend_s
    res = b.step(forward=False)
    assert res.invalid_block_ids and res.load_s < deadline_s + backend_s + 0.4
    time.sleep(2 * backend_s + 0.1)  # let anything still queued run
    # Both shards were asked at once, before the deadline (one call each, in parallel); nothing after it.
    assert [f.calls["read_ranges"] for f in flaky] == [1, 1]
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_a_frozen_shard_costs_one_timeout_per_load_not_one_per_layer_group() -> None:
    # DESIGN: a dead or frozen shard costs one timeout, not one per request (lookups and saves back off for
    # backend_retry_s). With one layer per bank the load below is 4 layer groups; the first one's read times out,
    # which fails every chunk, yet groups 2-4 are read from the frozen shard and waited for, one timeout each, up to
    # load_deadline_s (30 s by default): the step stalls for min(groups x backend_timeout_s, load_deadline_s).
    backend_s = 0.15
    inner = shard_backends(1, 1)
    flaky = wrap(inner, "layer-banks")
    prompt = prompt_tokens(150, seed=38)
    a, _ = produce(inner, prompt)
    b = Engine(flaky, load_deadline_s=5.0, backend_timeout_s=backend_s, seed=14,  # type: ignore[arg-type]
               **PATH_CONFIG["layer-banks"])
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    flaky[0].read_hang_s = backend_s
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    time.sleep(len(LAYERS) * backend_s)  # let anything still queued run, so the count below is final
    assert flaky[0].calls["read_ranges"] == 1  # today: one per layer group, each waited for (load_s ~ 4 x 0.15 s)
    assert res.load_s < 2.5 * backend_s
    a.close()
    b.close()
