"""The DRAM tier's in-scheduler index (``lookup_backends=None``): it learns saves and evictions from the worker's
metadata, offers nothing before the worker reports it, and forgets a chunk that loaded corrupt.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`).
"""

from __future__ import annotations

import pytest

from range_connector.backends.memory import MemoryBackend
from range_connector.kv.tickets import ticket_key
from tests.unit.scheduler_worker_harness import (
    CHUNK_BYTES_DENSE_32,
    Engine,
    FakeRequest,
    MiB,
    chain,
    flip_byte,
    mutate_stored_value,
    prompt_tokens,
    same_block,
    saved_chunk_idxs,
    saved_hashes,
    snapshot,
    stored_ticket,
)

# ---------------------------------------------------------------------------------------------------- DRAM index


@pytest.mark.timeout(30)
def test_dram_index_learns_saves_and_evictions_from_worker_metadata() -> None:
    dram = MemoryBackend(3 * CHUNK_BYTES_DENSE_32, name="dram")  # room for three chunks: one stripe of two
    eng = Engine([dram], lookup_backends=None, seed=8)
    prompt = prompt_tokens(150, seed=30)
    hashes = chain(prompt, 32)
    probe = FakeRequest("probe", prompt)

    eng.admit(FakeRequest("D-0", prompt), 70)
    s1 = eng.step()  # chunks 0, 1: one stripe
    assert s1.worker_meta is not None and saved_hashes(s1.worker_meta) == hashes[:2]
    assert s1.worker_meta.dropped == []
    for h, _group, tickets in s1.worker_meta.saved:  # the index learns the tickets the tier holds
        assert tickets == (stored_ticket(dram, h, 0),)
    assert len({t.stripe_id for _, _group, ts in s1.worker_meta.saved for t in ts}) == 1
    assert eng.sched.get_num_new_matched_tokens(probe, 0) == (64, False)  # the index learnt chunks 0, 1

    eng.continue_("D-0")
    s2 = eng.step()  # chunks 2, 3 saved as a second stripe; the first (least recently used) is evicted whole
    assert saved_hashes(s2.worker_meta) == hashes[2:4]
    assert s2.worker_meta is not None and s2.worker_meta.dropped == hashes[:2]
    assert dram.get_tickets([ticket_key(hashes[0], 0), ticket_key(hashes[1], 0)]) == [None, None]
    assert list(eng.sched.lookup.index) == hashes[2:4]
    assert eng.sched.get_num_new_matched_tokens(probe, 0) == (0, False)  # the prefix starts with a gap: a miss
    eng.sched.request_finished(probe, [])
    eng.finish("D-0")

    # The next request re-saves chunks 0, 1 (not in the index) and nothing else; that evicts chunks 2, 3, and
    # lookups follow the index.
    eng.admit(FakeRequest("D-1", prompt))
    s3 = eng.step()
    assert saved_chunk_idxs(s3.meta) == [0, 1]
    assert saved_hashes(s3.worker_meta) == hashes[:2]
    assert s3.worker_meta is not None and s3.worker_meta.dropped == hashes[2:4]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe2", prompt), 0) == (64, False)
    assert eng.sched.num_leases == 0  # the DRAM tier takes no leases
    eng.close()


@pytest.mark.timeout(30)
def test_dram_index_does_not_offer_a_save_before_the_worker_reports_it() -> None:
    dram = MemoryBackend(64 * MiB, name="dram")
    eng = Engine([dram], lookup_backends=None, seed=9)
    prompt = prompt_tokens(150, seed=31)
    eng.admit(FakeRequest("D-0", prompt), 70)
    meta = eng.sched.build_connector_meta(eng._scheduler_output())  # planned, not yet run by the worker
    assert saved_chunk_idxs(meta) == [0, 1]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe", prompt), 0) == (0, False)
    eng.worker.save(meta)
    eng.sched.update_connector_output(eng.worker.build_worker_meta())
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe", prompt), 0) == (64, False)
    eng.close()


@pytest.mark.timeout(30)
def test_dram_index_loads_byte_exact_and_forgets_a_corrupt_chunk() -> None:
    dram = MemoryBackend(64 * MiB, name="dram")
    eng = Engine([dram], lookup_backends=None, seed=10)
    prompt = prompt_tokens(150, seed=39)
    hashes = chain(prompt, 32)
    eng.admit(FakeRequest("D-0", prompt))
    eng.step()
    src = list(eng.running["D-0"].block_ids)
    eng.finish("D-0")
    saved = snapshot(eng.kv)
    t = eng.sched.lookup.index[hashes[3]][0]
    mutate_stored_value(dram, t.stripe_id, 3, flip_byte(t.plane_range(0)[0] + 1))

    assert eng.admit(FakeRequest("D-1", prompt)) == 128
    dst = eng.running["D-1"].block_ids
    res = eng.step(forward=False)
    assert res.invalid_block_ids == set(dst[6:8])
    for i in range(6):
        assert same_block(res.after_load, dst[i], saved, src[i])
    assert res.worker_meta is not None and res.worker_meta.dropped == [hashes[3]]
    assert list(eng.sched.lookup.index) == hashes[:3]
    assert eng.sched.get_num_new_matched_tokens(FakeRequest("probe", prompt), 0) == (96, False)
    eng.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retain_evicted", [True, False], ids=["retained", "freed-at-once"])
def test_a_dram_hit_evicted_before_the_scheduler_learnt_it_still_loads(retain_evicted: bool) -> None:
    """Asynchronous scheduling plans step N+1 before it learns step N's report: a lookup can promise a stripe that
    step N's saves evicted. The worker keeps it readable until the scheduler has learnt the eviction. Freed at once
    (the tier without ``retain_evicted``), the same steps fail the load: the test can tell the two apart."""
    dram = MemoryBackend(3 * CHUNK_BYTES_DENSE_32, name="dram", retain_evicted=retain_evicted)
    eng = Engine([dram], lookup_backends=None, seed=11)
    prompt = prompt_tokens(150, seed=40)
    hashes = chain(prompt, 32)
    eng.admit(FakeRequest("D-0", prompt), 70)
    eng.step()  # chunks 0, 1: one stripe
    src = list(eng.running["D-0"].block_ids)
    saved = snapshot(eng.kv)
    eng.continue_("D-0")
    s2 = eng.step(hold_report=True)  # chunks 2, 3 saved; chunks 0, 1's stripe evicted; not learnt yet
    assert s2.worker_meta is not None and s2.worker_meta.dropped == hashes[:2]
    assert dram.get_tickets([ticket_key(hashes[0], 0)]) == [None]  # nothing new can find the evicted stripe
    assert dram.num_retired() == (1 if retain_evicted else 0)
    eng.finish("D-0")

    assert eng.admit(FakeRequest("D-1", prompt), 70) == 64  # the index has not learnt the eviction
    dst = eng.running["D-1"].block_ids
    s3 = eng.step(forward=False)
    if not retain_evicted:
        assert s3.invalid_block_ids == set(dst[:4])  # the promised stripe was gone: vLLM recomputes it
        eng.close()
        return
    assert s3.invalid_block_ids == set()
    for i in range(4):
        assert same_block(s3.after_load, dst[i], saved, src[i])
    assert s3.meta.reports_learnt_through == 0 and dram.num_retired() == 1  # (planned before report 1 was learnt)
    eng.continue_("D-1")
    eng.step()  # built after reports 1 and 2 were learnt: the retired stripe goes
    assert dram.num_retired() == 0 and dram.retired_bytes() == 0
    eng.close()


def test_dram_tier_holds_retired_stripes_beside_its_budget_at_most_the_budget_again() -> None:
    """Retired stripes leave the budget (``used_bytes``) and are held beside it up to ``capacity_bytes``, oldest
    freed first past that; reported ones go once the scheduler has learnt the report."""
    from range_connector.backends.base import StripeWrite

    dram = MemoryBackend(400, name="dram", retain_evicted=True)

    def write(sid: str) -> bool:
        return dram.write_stripe(StripeWrite(sid, [sid.encode() * 100] * 2, [(b"k" + sid.encode(), b"t")]))

    assert write("a") and write("b")  # 400 of 400
    assert write("c")  # "a" evicted: retired, readable, its ticket gone
    assert dram.used_bytes() == 400 and dram.retired_bytes() == 200 and dram.num_retired() == 1
    assert dram.get_tickets([b"ka"]) == [None]
    assert bytes(dram.view_stripes(["a"])[0][0]) == b"a" * 100
    assert dram.take_evicted(stamp=7) == [b"ka"]
    assert write("d") and write("e")  # "b", "c" retired too: 600 > 400 beside the budget, the oldest ("a") goes
    assert dram.retired_bytes() == 400 and dram.retired_freed_early == 1 and dram.view_stripes(["a"]) == [None]
    assert dram.take_evicted(stamp=8) == [b"kb", b"kc"]
    assert dram.free_retired(7) == 0  # ("a", the one stamped 7, was already freed)
    assert dram.free_retired(8) == 2 and dram.retired_bytes() == 0 and dram.used_bytes() == 400
    assert dram.view_stripes(["b"]) == [None]
    assert write("f") and dram.take_evicted() == [b"kd"] and dram.num_retired() == 0  # no stamp: freed at once
