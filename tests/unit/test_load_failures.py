"""Loads that fail: tier errors, corrupt or missing stripe bytes, tickets that do not fit, and hits limited by the
poorest shard. A failed load reports its blocks (vLLM recomputes them) and never leaves garbage in the KV cache.

Driven through the engine-less harness (:mod:`tests.unit.scheduler_worker_harness`), with failures and damage
injected at the backend boundary (``FlakyBackend``) or into the stored values.
"""

from __future__ import annotations

import pytest

from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.kv.tickets import ticket_key
from tests.unit.scheduler_worker_harness import (
    BLOCK,
    LOAD_PATHS,
    PATH_CONFIG,
    Engine,
    FakeRequest,
    chain,
    changed_blocks,
    flip_byte,
    live_leases,
    lose_stripe,
    mutate_stored_value,
    produce,
    prompt_tokens,
    same_block,
    shard_backends,
    stored_ticket,
    wrap,
)


# ---------------------------------------------------------------------------------------------------- load failure
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", ["bank", "layer-banks", "direct"])
@pytest.mark.parametrize("exc", [BackendError, BackendTimeoutError])
@pytest.mark.parametrize(("num_shards", "failing_shard"), [(1, 0), (2, 0), (2, 1)])
def test_load_backend_error_reports_every_block_and_writes_nothing(
    num_shards: int, failing_shard: int, exc: type[BackendError], path: str
) -> None:
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner, path)
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=13)
    a, _ = produce(inner, prompt, **kw)

    b = Engine(flaky, seed=4, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    ext = b.admit(FakeRequest("B-0", prompt))
    assert ext == 128
    flaky[failing_shard].fail_read = exc
    res = b.step(forward=False)  # no exception escapes

    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:ext // BLOCK])
    if path == "direct":  # the other shard's rows landed in their blocks before the load failed: reported too
        assert changed_blocks(res.before, res.after_load) <= res.invalid_block_ids
        assert num_shards == 2 or changed_blocks(res.before, res.after_load) == set()
    else:
        assert changed_blocks(res.before, res.after_load) == set()
    assert res.loaded_block_log == []
    # One error per load: a failed shard is not asked again for later layer groups.
    assert b.worker.stats["load_backend_errors"] == 1  # a failed shard is not asked again in this load
    assert b.worker.stats["failed_blocks"] == ext // BLOCK
    assert b.worker.stats["loaded_blocks"] == 0
    # A tier error is not evidence against the bytes: nothing is deleted or reported dropped.
    assert all(f.calls["delete_tickets"] == 0 for f in flaky)
    assert res.worker_meta is not None and res.worker_meta.dropped == []
    assert res.worker_meta.failed_loads == [("B-0", 0)] and res.worker_meta.loaded == ["B-0"]
    assert b.sched.num_leases == 0 and live_leases(inner) == 0  # the failed load still ends the lease
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_view_error_is_transient_and_deletes_nothing() -> None:
    # The bank path keeps errored reads (transient: tickets kept) apart from stripes that are gone (tickets
    # dropped); _view_sources turns an exception into [None] * n, i.e. "gone", so one failed call forgets the
    # prefix on that shard for every engine.
    inner = shard_backends(2, 2)
    flaky = wrap(inner, "views")
    prompt = prompt_tokens(150, seed=42)
    a, _ = produce(inner, prompt, num_shards=2)
    b = Engine(flaky, num_shards=2, seed=15)  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    flaky[1].fail_read = BackendError
    res = b.step(forward=False)
    assert res.invalid_block_ids == set(b.running["B-0"].block_ids[:8])
    assert b.worker.stats["load_backend_errors"] == 1
    assert all(f.calls["delete_tickets"] == 0 for f in flaky)
    assert res.worker_meta is not None and res.worker_meta.dropped == []
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (128, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
@pytest.mark.parametrize(("num_shards", "bad_shard"), [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("damage", ["stored-byte-flipped", "read-byte-flipped"])
def test_corrupt_stripe_bytes_fail_their_chunk_and_later_ones_and_the_ticket_is_deleted(
    num_shards: int, bad_shard: int, damage: str, path: str
) -> None:
    inner = shard_backends(num_shards, num_shards)
    flaky = wrap(inner, path)
    kw = dict(num_shards=num_shards)
    prompt = prompt_tokens(150, seed=14)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt, **kw)  # stripes: chunks 0-1, chunks 2-3 (per shard)
    bad_chunk, bad_layer = 2, 1
    bps = 2 // num_shards
    t = stored_ticket(inner[bad_shard], hashes[bad_chunk], bad_shard, blocks_per_shard=bps)
    assert t is not None
    offset = t.plane_range(0)[0] + 7  # a byte inside the bad chunk's slice of layer 1
    if damage == "stored-byte-flipped":
        mutate_stored_value(inner[bad_shard], t.stripe_id, bad_layer, flip_byte(offset))
    else:
        flaky[bad_shard].corrupt_reads.add((t.stripe_id, bad_layer, offset))

    b = Engine(flaky, seed=5, verify_checksums=True, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    bpc = 2
    good = b_blocks[:bad_chunk * bpc]
    assert res.invalid_block_ids == set(b_blocks[bad_chunk * bpc:8])  # the bad chunk and every later one
    if path in ("layer-banks", "views", "direct"):
        # layer-banks: layer 0 of the failed chunks was copied before layer 1 failed; views: whole stripes are
        # verified while they are copied; direct: the bytes land in the blocks before they are verified. Either way
        # the written blocks are reported, so vLLM recomputes them.
        assert changed_blocks(res.before, res.after_load) == set(b_blocks[:8])
    else:
        assert changed_blocks(res.before, res.after_load) == set(good)
    for i, blk in enumerate(good):
        assert same_block(res.after_load, blk, a.kv, a_blocks[i])
    assert b.worker.stats["load_integrity_errors"] == 1
    # C27: the bad chunk's ticket is deleted (a phantom is not offered again) and reported as dropped; the later
    # chunk of the same stripe was not read wrong and keeps its ticket.
    assert stored_ticket(inner[bad_shard], hashes[bad_chunk], bad_shard, blocks_per_shard=bps) is None
    for s in range(num_shards):
        assert stored_ticket(inner[s], hashes[bad_chunk + 1], s, blocks_per_shard=bps) is not None
        assert stored_ticket(inner[s], hashes[bad_chunk - 1], s, blocks_per_shard=bps) is not None
    assert res.worker_meta is not None and res.worker_meta.dropped == [hashes[bad_chunk]]
    assert res.worker_meta.failed_loads == [("B-0", bad_chunk)]
    # The next lookup stops before the deleted chunk.
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (bad_chunk * 32, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
def test_flipped_stored_byte_without_verification_is_loaded_as_is(path: str) -> None:
    # verify_checksums = false trades the checksum for speed: ticket bounds are still checked, the bytes not.
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=15)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(inner, prompt)
    t = stored_ticket(inner[0], hashes[1], 0)
    assert t is not None
    mutate_stored_value(inner[0], t.stripe_id, 0, flip_byte(t.plane_range(0)[0] + 3))
    b = Engine(wrap(inner, path), seed=5, verify_checksums=False, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    assert res.invalid_block_ids == set()
    assert b.worker.stats["load_integrity_errors"] == 0
    assert not same_block(res.after_load, b_blocks[2], a.kv, a_blocks[2])  # the damaged block, as stored
    assert all(same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i]) for i in (0, 1, 3, 4, 5, 6, 7))
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", LOAD_PATHS)
def test_stripe_missing_on_one_shard_between_lookup_and_load_is_a_load_error(path: str) -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=16)
    hashes = chain(prompt, 32)
    a, a_blocks = produce(backends, prompt, **kw)
    b = Engine(wrap(backends, path), seed=6, **kw, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128  # promised, then shard 1 loses the stripe of chunks 2-3
    t = stored_ticket(backends[1], hashes[2], 1, blocks_per_shard=1)
    assert t is not None
    lose_stripe(backends[1], t.stripe_id)
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)

    assert res.invalid_block_ids == set(b_blocks[4:8])
    if path == "direct":  # shard 0's rows of chunks 2-3 landed before shard 1's were found gone: reported too
        assert set(b_blocks[:4]) <= changed_blocks(res.before, res.after_load) <= set(b_blocks[:8])
    else:
        assert changed_blocks(res.before, res.after_load) == set(b_blocks[:4])
    for i in range(4):
        assert same_block(res.after_load, b_blocks[i], a.kv, a_blocks[i])
    assert b.worker.stats["load_integrity_errors"] == 0 and b.worker.stats["load_backend_errors"] == 0
    assert res.worker_meta is not None and res.worker_meta.failed_loads == [("B-0", 2)]
    # The ticket that points at the lost stripe is not offered again: deleted and reported dropped.
    assert res.worker_meta.dropped == [hashes[2]]
    assert stored_ticket(backends[1], hashes[2], 1, blocks_per_shard=1) is None
    assert stored_ticket(backends[0], hashes[2], 0, blocks_per_shard=1) is not None
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0) == (64, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_hit_is_the_minimum_over_shards() -> None:
    backends = shard_backends(2, 2)
    kw = dict(num_shards=2)
    prompt = prompt_tokens(150, seed=17)
    hashes = chain(prompt, 32)
    a, _ = produce(backends, prompt, **kw)
    backends[1].delete_tickets([ticket_key(hashes[2], 1)])  # shard 1 holds chunks 0, 1 (and 3, unreachable)
    b = Engine(backends, seed=6, **kw)
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (64, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
def test_ticket_that_does_not_fit_the_layout_is_a_miss() -> None:
    # A ticket written by an engine of another layout (here MLA under the same namespace, which the namespace
    # normally prevents) is a miss, never a read of wrong geometry.
    backends = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=18)
    a, _ = produce(backends, prompt, kind="mla")
    b = Engine(backends, seed=6, kind="dense")
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-0", prompt), 0) == (0, False)
    a.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", [
    "bank",
    "layer-banks",
    "views",
    "direct",
])
def test_value_shorter_than_its_ticket_is_treated_as_corrupt(path: str) -> None:
    # base.py: read_ranges raises ValueError when "a read falls outside its stored value (a ticket that lies;
    # caller treats as corrupt)". The worker catches it with BackendError: the whole shard's reads of the step fail
    # (every request, every stripe), nothing is deleted or reported dropped, and every later lookup promises the
    # same chunks again -- on a consumer (which never re-saves them) or a DRAM index (which skips re-saving chunks
    # it still indexes) the prefix then fails to load forever. (The view path takes a lent value of the wrong size
    # for a stripe that is gone, and drops its ticket: that is the expected outcome.)
    inner = shard_backends(1, 1)
    prompt = prompt_tokens(150, seed=19)
    hashes = chain(prompt, 32)
    a, _ = produce(inner, prompt)  # stripes: chunks 0-1, chunks 2-3
    t = stored_ticket(inner[0], hashes[2], 0)
    assert t is not None
    mutate_stored_value(inner[0], t.stripe_id, 2, lambda v: v[:-1])
    b = Engine(wrap(inner, path), seed=5, can_save=False, **PATH_CONFIG[path])  # type: ignore[arg-type]
    assert b.admit(FakeRequest("B-0", prompt)) == 128
    b_blocks = b.running["B-0"].block_ids
    res = b.step(forward=False)
    assert set(b_blocks[4:8]) <= res.invalid_block_ids  # no exception, chunks 2-3 recomputed
    # Expected: the lying chunk is forgotten like a corrupt one.
    assert res.worker_meta is not None and hashes[2] in res.worker_meta.dropped
    assert b.sched.get_num_new_matched_tokens(FakeRequest("B-1", prompt), 0)[0] <= 64
    a.close()
    b.close()
