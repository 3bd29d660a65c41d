"""A request's life through both halves: what is saved (and not saved again), preemption and resumption with new
blocks, the state a finished request leaves, and the bugs found in this harness (fixed since).

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`).
"""

from __future__ import annotations

import pytest

from range_connector.errors import BackendError
from range_connector.kv.tickets import ticket_key
from tests.unit.scheduler_worker_harness import (
    NUM_BLOCKS,
    Engine,
    FakeRequest,
    FlakyBackend,
    MiB,
    chain,
    live_leases,
    produce,
    prompt_tokens,
    same_block,
    saved_chunk_idxs,
    saved_hashes,
    shard_backends,
    stored_ticket,
)


# ---------------------------------------------------------------------------------------------------- bookkeeping
@pytest.mark.timeout(30)
def test_chunks_stored_before_are_not_saved_again() -> None:
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=26)
    a, _ = produce(backends, prompt)
    longer = prompt + prompt_tokens(64, seed=27)  # 214 tokens: chunks 0-3 stored, 4-5 new
    b = Engine(backends, seed=4)
    assert b.admit(FakeRequest("B-0", longer), 40) == 128
    s1 = b.step()  # loads 0-3, computes [128, 168): chunk 4 becomes full
    assert saved_chunk_idxs(s1.meta) == [4]
    b.continue_("B-0")
    s2 = b.step()
    assert saved_chunk_idxs(s2.meta) == [5]
    b.continue_("B-0", 1)
    assert b.step().meta.saves == []  # decode tokens are never saved
    # The same prompt again: everything is stored, nothing is saved.
    b.finish("B-0")
    assert b.admit(FakeRequest("B-1", longer)) == 192
    assert b.step().meta.saves == []
    assert b.worker.stats["saved_stripes"] == 2
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("resumed_as_new", [False, True], ids=["resumed-cached", "resumed-new-v2-runner"])
def test_preempted_request_resumes_with_new_blocks(resumed_as_new: bool) -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=28)
    eng = Engine(backends, seed=5, **kw)
    req = FakeRequest("R-0", prompt)
    eng.admit(req, 70)
    s1 = eng.step()
    assert saved_chunk_idxs(s1.meta) == [0, 1]
    old_blocks = list(eng.running["R-0"].block_ids)
    eng.preempt("R-0")
    eng.take_blocks(5)  # other requests take the freed blocks: the resumed request gets different ones

    # Resumed: vLLM looks it up again (its own saved chunks hit) and sends the whole new block list.
    assert eng.admit(req, resumed=True, resumed_as_new=resumed_as_new) == 64
    assert eng.sched.num_leases == 1
    new_blocks = list(eng.running["R-0"].block_ids)
    assert not set(new_blocks) & set(old_blocks)
    s2 = eng.step()
    assert s2.invalid_block_ids == set()
    assert eng.sched.num_leases == 0 and live_leases(backends) == 0
    [load] = s2.meta.loads
    assert [x for c in load.chunks for x in c.block_ids] == new_blocks[:4]
    assert saved_chunk_idxs(s2.meta) == [2, 3]
    assert {x for r in s2.meta.saves for c in r.chunks for x in c.block_ids} == set(new_blocks[4:8])
    # What was saved from the new blocks is what another engine loads.
    reader = Engine(backends, seed=6, **kw)
    assert reader.admit(FakeRequest("X-0", prompt)) == 128
    r_blocks = reader.running["X-0"].block_ids
    res = reader.step(forward=False)
    assert res.invalid_block_ids == set()
    for i in range(8):
        assert same_block(res.after_load, r_blocks[i], eng.kv, new_blocks[i]), i
    eng.close()
    reader.close()


@pytest.mark.timeout(30)
def test_finished_requests_leave_no_state() -> None:
    backends = shard_backends(2, 1, capacity_bytes=2 * MiB)
    eng = Engine(backends, num_shards=2, seed=7)
    shared = prompt_tokens(64, seed=29)
    for i in range(25):
        prompt = shared + prompt_tokens(40 + i % 50, seed=100 + i)
        req = FakeRequest(f"q{i}", prompt)
        # vLLM may ask several times before it can schedule a request: only the latest lookup is kept.
        eng.sched.get_num_new_matched_tokens(req, 0)
        eng.admit(req, 50)
        eng.step()
        if len(prompt) > eng.running[req.request_id].num_computed_tokens:
            eng.continue_(req.request_id)
            eng.step()
        eng.continue_(req.request_id, 1)
        eng.step()
        eng.finish(req.request_id)
        if i % 3 == 0:  # the id also reaches the scheduler half through finished_req_ids
            eng.step()
        # A request that was looked up but aborted before it was scheduled.
        aborted = FakeRequest(f"abort{i}", prompt)
        eng.sched.get_num_new_matched_tokens(aborted, 0)
        assert eng.sched.request_finished(aborted, []) == (False, None)
    eng.step()
    assert eng.sched._requests == {}
    assert eng.sched._lookups == {}
    assert eng.sched._loads == []
    assert eng.sched.num_leases == 0 and live_leases(backends) == 0
    assert eng.running == {} and len(eng.free) == NUM_BLOCKS
    eng.close()

# ------------------------------------------------------------------------- bugs found here, fixed since
@pytest.mark.timeout(30)
@pytest.mark.parametrize("failure", ["backend-error", "corrupt-chunk"])
def test_chunks_computed_on_top_of_a_failed_load_are_not_saved(failure: str) -> None:
    # vLLM runs the forward of a step even when its sync load failed, and only afterwards learns of the failure
    # (invalid_block_ids); it then recomputes from the first failed block and evicts that block "and all downstream
    # dependent blocks" from its own prefix cache (scheduler.py L3312-3314). The KV computed in that step past the
    # failed blocks attended to garbage, so the connector must not store it.
    inner = shard_backends(1, 1)
    flaky = [FlakyBackend(inner[0])]
    prompt = prompt_tokens(96, seed=34)  # 3 chunks stored by A
    a, _ = produce(inner, prompt, first_step_tokens=40)
    longer = prompt + prompt_tokens(70, seed=35)  # 166 tokens: chunks 3, 4 are computed by B in one step
    hashes = chain(longer, 32)
    if failure == "backend-error":
        flaky[0].fail_read = BackendError
    else:
        t = stored_ticket(inner[0], hashes[1], 0)
        assert t is not None
        flaky[0].corrupt_reads.add((t.stripe_id, 0, t.plane_range(0)[0]))
    b = Engine(flaky, seed=11)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", longer)) == 96
    res = b.step()
    assert res.invalid_block_ids  # the load failed ...
    assert saved_chunk_idxs(res.meta) == [3, 4]  # ... and the plan still holds the saves of chunks 3, 4
    # Expected: nothing computed on top of the failure is stored (or reported saved).
    assert inner[0].get_tickets([ticket_key(hashes[3], 0), ticket_key(hashes[4], 0)]) == [None, None]
    assert flaky[0].calls["write_stripe"] == 0
    assert not set(saved_hashes(res.worker_meta)) & set(hashes[3:])
    assert b.worker.stats["saves_dropped_after_failed_load"] == 2
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_producer_does_not_save_chunks_already_stored() -> None:
    # A prefill-only engine (docs/disaggregated.md) serving the same long system prompt twice.
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=36)
    p = Engine(backends, can_load=False, can_save=True, seed=3)
    p.admit(FakeRequest("P-0", prompt))
    assert saved_chunk_idxs(p.step().meta) == [0, 1, 2, 3, 4]  # a producer also stores the partial last chunk
    p0_blocks = list(p.running["P-0"].block_ids)
    p.finish("P-0")
    written = backends[0].counters.bytes_written
    # The second request hits vLLM's local prefix cache for 128 tokens (P-0's blocks, still cached).
    local = p0_blocks[:8]
    p.free = [b for b in p.free if b not in local]
    assert p.admit(FakeRequest("P-1", prompt), local_blocks=local) == 0
    res = p.step()
    assert res.meta.saves == []
    assert backends[0].counters.bytes_written == written
    p.close()
