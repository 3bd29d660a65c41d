"""Leases on promised stripes: taken on every shard at the promise, released once the load is reported, never
outliving their request, keeping a promised stripe from eviction while live, and never cutting another holder's.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`), with stores that share one
byte budget between engines.
"""

from __future__ import annotations

import pytest

from range_connector.backends.memory import MemoryBackend
from range_connector.errors import BackendError, BackendTimeoutError
from tests.unit.clocks import VirtualClock
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    CHUNK_BYTES_DENSE_32,
    NUM_BLOCKS,
    Engine,
    FakeRequest,
    FlakyBackend,
    MiB,
    chain,
    changed_blocks,
    live_leases,
    produce,
    prompt_tokens,
    same_block,
    shard_backends,
    stored_ticket,
)


# ---------------------------------------------------------------------------------------------------- leases
@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_promised_stripes_are_leased_on_every_shard_until_the_load_finishes(num_shards: int) -> None:
    inner = shard_backends(num_shards, num_shards, capacity_bytes=4 * MiB)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=60)
    hashes = chain(prompt, 32)
    bps = 2 // num_shards
    a, _ = produce(inner, prompt, **kw)  # two stripes per shard
    b = Engine(flaky, seed=23, **kw)  # type: ignore[arg-type]
    assert b.sched.num_leases == 0
    assert b.admit(FakeRequest("B-0", prompt), 10) == 128  # promised: leased at update_state_after_alloc
    assert b.sched.num_leases == 1
    for s, m in enumerate(inner):
        stripes = {stored_ticket(m, h, s, blocks_per_shard=bps).stripe_id for h in hashes[:4]}  # type: ignore
        assert len(stripes) == 2
        assert m.num_leases() == 2  # type: ignore[attr-defined]
        assert sorted(b.sched.leases.held["B-0"][s][0]) == sorted(stripes)
        assert flaky[s].calls["lease"] == 1  # one call per shard, both stripes
    res = b.step()
    assert res.invalid_block_ids == set()
    assert res.worker_meta is not None and res.worker_meta.loaded == ["B-0"]
    # Released as soon as the worker reports the load finished, while the request keeps running.
    assert "B-0" in b.running
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    assert [f.calls["release"] for f in flaky] == [1] * num_shards
    b.continue_("B-0")
    b.step()
    b.finish("B-0")
    b.step()
    assert [f.calls["release"] for f in flaky] == [1] * num_shards  # nothing left to release
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_no_lease_outlives_its_request() -> None:
    # C16: after many requests -- loads, loads skipped because vLLM holds the blocks locally, lookups never
    # scheduled, requests aborted while their load step runs, preempted and resumed requests, failed loads --
    # the scheduler holds no lease and neither does any shard.
    inner = shard_backends(2, 2, capacity_bytes=1 * MiB)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    eng = Engine(flaky, num_shards=2, seed=24)  # type: ignore[arg-type]
    shared = prompt_tokens(96, seed=61)
    peak = 0
    for i in range(30):
        prompt = shared + prompt_tokens(20 + (7 * i) % 60, seed=200 + i)
        req = FakeRequest(f"q{i}", prompt)
        kind = i % 6
        if kind == 0 or i < 2:  # plain: load the shared prefix, compute the rest
            ext = eng.admit(req)
            peak = max(peak, eng.sched.num_leases, live_leases(inner))
            eng.step()
        elif kind == 1:  # vLLM holds every stored block locally: nothing to load, nothing leased
            n = eng.sched.get_num_new_matched_tokens(req, 0)[0]
            local = eng.take_blocks(n // BLOCK)
            assert eng.admit(req, local_blocks=local) == 0
            assert eng.sched.num_leases == 0
            eng.step()
        elif kind == 2:  # looked up (maybe several times) and aborted before it was ever scheduled
            eng.sched.get_num_new_matched_tokens(req, 0)
            eng.sched.get_num_new_matched_tokens(req, 0)
            assert eng.sched.request_finished(req, []) == (False, None)
            continue
        elif kind == 3:  # aborted while its load step runs: request_finished before the worker's output
            ext = eng.admit(req)
            assert ext > 0 and eng.sched.num_leases == 1
            eng.step(abort_mid_step=[req.request_id])
            assert eng.sched.num_leases == 0
            continue
        elif kind == 4:  # loaded, preempted, resumed (leased again), loaded again
            ext = eng.admit(req, 40)
            eng.step()
            eng.preempt(req.request_id)
            assert eng.admit(req, resumed=True) > 0
            assert eng.sched.num_leases == 1
            eng.step()
        else:  # the load fails on one shard
            flaky[1].fail_read = BackendError
            ext = eng.admit(req)
            assert ext > 0
            res = eng.step()
            flaky[1].fail_read = None
            assert res.invalid_block_ids
        assert eng.sched.num_leases == 0, i
        if req.request_id in eng.running:
            eng.continue_(req.request_id, 1)
            eng.step()
            eng.finish(req.request_id)
        if i % 4 == 0:
            eng.step()
    eng.step()
    assert peak > 0
    assert eng.sched.num_leases == 0
    assert live_leases(inner) == 0
    assert sum(f.calls["lease"] for f in flaky) == sum(f.calls["release"] for f in flaky) > 0
    assert eng.sched._requests == {} and eng.sched._lookups == {} and eng.sched._loads == []
    assert eng.running == {} and len(eng.free) == NUM_BLOCKS
    eng.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lease", ["live", "expired"])
def test_a_leased_stripe_is_not_evicted_by_a_save_that_needs_room(lease: str) -> None:
    # C15: between the lookup that promised a stripe and the load, another engine's save needs room, and the
    # promised stripe is the least recently used one. A live lease keeps it (the next unleased one goes instead);
    # an expired lease protects nothing (the load then fails cleanly).
    stripe4, stripe2 = 4 * CHUNK_BYTES_DENSE_32, 2 * CHUNK_BYTES_DENSE_32
    clock = VirtualClock()  # leases expire when the test says, not when this machine happens to be slow
    dram = MemoryBackend(stripe4 + stripe2 + CHUNK_BYTES_DENSE_32, name="shared-tier", clock=clock)
    p1, p0, p2 = prompt_tokens(150, seed=62), prompt_tokens(70, seed=63), prompt_tokens(70, seed=64)
    h1, h0, h2 = chain(p1, 32), chain(p0, 32), chain(p2, 32)
    a, a_blocks = produce([dram], p1, first_step_tokens=None)  # stripe S1 (4 chunks)
    a0, _ = produce([dram], p0, first_step_tokens=None, req_id="A-1", seed=11)  # stripe S0 (2 chunks)
    assert dram.used_bytes() == stripe4 + stripe2

    b = Engine([dram], seed=25, lease_ttl_s=60.0 if lease == "live" else 0.02)
    assert b.admit(FakeRequest("B-0", p1)) == 128
    assert dram.num_leases() == 1
    if lease == "expired":
        clock.advance(0.1)
    d = Engine([dram], seed=33)  # another engine reads S0: S1 becomes the least recently used stripe
    assert d.admit(FakeRequest("D-0", p0)) == 64
    assert d.step(forward=False).invalid_block_ids == set()
    c = Engine([dram], seed=26)
    c.admit(FakeRequest("C-0", p2))
    c.step()  # saves a 2-chunk stripe: one stripe must go
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    if lease == "live":
        assert c.worker.stats["saved_chunks"] == 2
        assert [stored_ticket(dram, h, 0) is not None for h in h1[:4]] == [True] * 4
        assert [stored_ticket(dram, h, 0) for h in h0[:2]] == [None, None]  # the unleased stripe went
        assert res.invalid_block_ids == set()
        for i in range(8):
            assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]), i
    else:
        assert [stored_ticket(dram, h, 0) for h in h1[:4]] == [None] * 4  # the promised stripe went
        assert [stored_ticket(dram, h, 0) is not None for h in h0[:2] + h2[:2]] == [True] * 4
        assert res.invalid_block_ids == set(b_blocks[:8])  # a miss, never garbage
        assert changed_blocks(res.before, res.after_load) == set()
    assert b.sched.num_leases == 0 and dram.num_leases() == 0
    for e in (a, a0, b, c, d):
        e.close()


@pytest.mark.timeout(30)
def test_a_live_lease_blocks_a_save_when_nothing_else_can_go() -> None:
    dram = MemoryBackend(4 * CHUNK_BYTES_DENSE_32 + CHUNK_BYTES_DENSE_32, name="shared-tier")
    p1, p2 = prompt_tokens(150, seed=65), prompt_tokens(70, seed=66)
    a, a_blocks = produce([dram], p1, first_step_tokens=None)
    b = Engine([dram], seed=27)
    assert b.admit(FakeRequest("B-0", p1)) == 128
    c = Engine([dram], seed=28)
    c.admit(FakeRequest("C-0", p2))
    c.step()
    assert c.worker.stats["saves_skipped_capacity"] == 1 and c.worker.stats["saved_chunks"] == 0
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    b_blocks = b.running["B-0"].block_ids
    assert all(same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]) for i in range(8))
    # Once the load finished, the same save makes room.
    assert dram.num_leases() == 0
    c.admit(FakeRequest("C-1", p2))
    c.step()
    assert c.worker.stats["saved_chunks"] == 2
    for e in (a, b, c):
        e.close()


@pytest.mark.timeout(30)
def test_a_lease_that_cannot_be_taken_only_risks_the_load() -> None:
    inner = shard_backends(2, 2)
    flaky = [FlakyBackend(m, name=f"flaky-s{s}") for s, m in enumerate(inner)]
    prompt = prompt_tokens(150, seed=67)
    a, a_blocks = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, seed=29)  # type: ignore[arg-type]
    flaky[1].fail_lease = BackendTimeoutError
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    assert b.sched.stats["lease_errors"] == 1
    assert live_leases(inner) == 2  # shard 0's two stripes
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    b_blocks = b.running["B-0"].block_ids
    assert all(same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]) for i in range(8))
    assert b.sched.num_leases == 0 and live_leases(inner) == 0
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_releasing_an_expired_lease_leaves_another_holders_lease() -> None:
    # base.py: "leases are counted, so two holders need two releases; ... releasing an expired lease is harmless".
    # B1's lease expires before its load finishes (a step slower than lease_ttl_s); B2 leases the same stripe; an
    # eviction pass prunes B1's expired entry; B1's release then removes B2's live lease, and B2's promised stripe
    # is unprotected until B2's load. (Valkey's counter behaves alike: B1's key expires, B2's INCR makes it 1,
    # B1's release DECRs it to 0 and deletes it.)
    clock = VirtualClock()
    dram = MemoryBackend(4 * CHUNK_BYTES_DENSE_32 + 3 * CHUNK_BYTES_DENSE_32, name="shared-tier", clock=clock)
    p1, p0, p2 = prompt_tokens(150, seed=68), prompt_tokens(70, seed=69), prompt_tokens(70, seed=70)
    a, _ = produce([dram], p1, first_step_tokens=None)  # S1
    a0, _ = produce([dram], p0, first_step_tokens=None, req_id="A-1", seed=11)  # S0
    b1 = Engine([dram], seed=30, lease_ttl_s=0.02)
    assert b1.admit(FakeRequest("B1", p1)) == 128
    clock.advance(0.1)
    b2 = Engine([dram], seed=31)
    assert b2.admit(FakeRequest("B2", p1)) == 128
    d = Engine([dram], seed=33)  # reads S0: S1 becomes the least recently used stripe
    assert d.admit(FakeRequest("D-0", p0)) == 64
    d.step(forward=False)
    c = Engine([dram], seed=32)
    c.admit(FakeRequest("C-0", p2))
    c.step()  # needs room: passes the leased S1 (pruning B1's expired entry), evicts S0
    assert c.worker.stats["saved_chunks"] == 2
    b1.step(forward=False)  # B1's load finishes: it releases its (expired) lease
    assert b2.sched.num_leases == 1
    assert dram.num_leases() == 1  # B2's lease must still be live
    for e in (a, a0, b1, b2, c, d):
        e.close()
