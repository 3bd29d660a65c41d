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
