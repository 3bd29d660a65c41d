"""``range_connector.lmcache.objects.ObjectStore`` (the Range half of the LMCache L2 adapter, no LMCache needed)
against every tier: the DRAM tier, files (two shard directories) and real Valkey servers (two shards).

This is the part of the adapter that CI runs (it has no LMCache environment); ``tests/lmcache/test_l2_adapter.py``
runs the whole adapter through LMCache's interface where ``.venv-lmcache`` exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import valkey

from range_connector.backends.base import Backend
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.lmcache.objects import ObjectId, ObjectStore, object_id
from tests.conftest import ValkeyServers

pytestmark = pytest.mark.timeout(60)


def ids(prefix: str, n: int) -> list[ObjectId]:
    return [object_id("tiny/model", 0, 0, f"{prefix}:{i}".encode().ljust(32, b"\0"), "") for i in range(n)]


def payload(oid: ObjectId, nbytes: int = 4096) -> bytes:
    return (oid * (nbytes // len(oid) + 1))[:nbytes]


@pytest.fixture(params=["memory", "file", "valkey"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, ObjectStore]]:
    deployment = f"objs{os.getpid()}{abs(hash(request.node.name)) % 10**8}"
    backends: list[Backend]
    if request.param == "memory":
        backends = [MemoryBackend(None)]
    elif request.param == "file":
        backends = [FileBackend(tmp_path / f"shard-{s}") for s in range(2)]
    else:
        servers: ValkeyServers = request.getfixturevalue("valkey_servers")
        backends = [ValkeyBackend(u, deployment=deployment) for u in servers.urls]
    store = ObjectStore(backends, lease_ttl_s=30.0)
    try:
        yield deployment, store
    finally:
        store.close()


def test_objects_round_trip_and_misses_are_false(tier: tuple[str, ObjectStore]) -> None:
    _, store = tier
    oids = ids("rt", 12)
    result = store.store(oids, [memoryview(payload(o)) for o in oids])
    assert result.stored == [True] * 12 and result.bytes_stored == 12 * 4096
    asked = oids + ids("missing", 1)
    tickets, leases = store.lookup(asked, lease=True)
    assert [t is not None for t in tickets] == [True] * 12 + [False]
    assert sorted(lease.shard_idx for lease in leases) == sorted({store.shard_of(o) for o in oids})
    dests = [bytearray(4096) for _ in asked[:-1]] + [bytearray(4096)]
    short = bytearray(100)  # a buffer of the wrong size is a miss, never a partial fill
    loaded = store.load(asked + [oids[0]], [memoryview(d) for d in dests] + [memoryview(short)], tickets + [None])
    assert loaded == [True] * 12 + [False, False]
    assert all(bytes(d) == payload(o) for d, o in zip(dests, oids))
    assert store.release(leases)
    assert store.used_bytes() == 12 * 4096


def test_a_corrupt_object_is_false_and_forgotten_the_others_load(valkey_servers: ValkeyServers) -> None:
    deployment = f"objcorrupt{os.getpid()}"
    store = ObjectStore([ValkeyBackend(u, deployment=deployment) for u in valkey_servers.urls], lease_ttl_s=30.0)
    try:
        oids = ids("corrupt", 6)
        assert all(store.store(oids, [memoryview(payload(o)) for o in oids]).stored)
        tickets, _ = store.lookup(oids, lease=False)
        t = tickets[3]
        admin = valkey.Valkey.from_url(valkey_servers.urls[store.shard_of(oids[3])])
        key = f"rc3:{deployment}:s:{t.stripe_id}:0"
        old = admin.getrange(key, t.block_offset + 7, t.block_offset + 7)
        admin.setrange(key, t.block_offset + 7, bytes([old[0] ^ 1]))
        admin.close()
        dests = [bytearray(4096) for _ in oids]
        assert store.load(oids, [memoryview(d) for d in dests]) == [True, True, True, False, True, True]
        assert store.lookup(oids[3:4], lease=False)[0] == [None], "the corrupt object's ticket must be deleted"
    finally:
        store.close()


def test_round_trips_per_shard_do_not_grow_with_the_object_count(valkey_servers: ValkeyServers) -> None:
    costs = []
    for n in (8, 256):
        store = ObjectStore([ValkeyBackend(u, deployment=f"objflat{n}{os.getpid()}") for u in valkey_servers.urls],
                            lease_ttl_s=30.0)
        try:
            oids = ids(f"flat{n}", n)
            per_op = []
            for op in (lambda: store.store(oids, [memoryview(payload(o)) for o in oids]),
                       lambda: store.lookup(oids, lease=True),
                       lambda: store.load(oids, [memoryview(bytearray(4096)) for _ in oids])):
                before = [b.counters.round_trips for b in store.backends]
                op()
                per_op.append([b.counters.round_trips - x for b, x in zip(store.backends, before)])
            costs.append(per_op)
        finally:
            store.close()
    assert costs[0] == costs[1]
    assert costs[0][0] == [1, 1], "a store is one round trip per shard"


def test_a_load_of_objects_stored_together_is_one_read_per_stripe(valkey_servers: ValkeyServers) -> None:
    """Objects stored by one task lie end to end in one stripe per shard: loading them all is one whole-value read
    (``GET``) per shard, for 8 objects as for 256 (client-side command counts)."""
    commands = []
    for n in (8, 256):
        store = ObjectStore([ValkeyBackend(u, deployment=f"objrun{n}{os.getpid()}") for u in valkey_servers.urls],
                            lease_ttl_s=30.0)
        try:
            oids = ids(f"run{n}", n)
            store.store(oids, [memoryview(payload(o)) for o in oids])
            tickets, _ = store.lookup(oids, lease=False)
            dests = [bytearray(4096) for _ in oids]
            before = [b.counters.commands for b in store.backends]
            assert store.load(oids, [memoryview(d) for d in dests], tickets) == [True] * n
            commands.append([b.counters.commands - x for b, x in zip(store.backends, before)])
            assert [bytes(d) for d in dests] == [payload(o) for o in oids]
        finally:
            store.close()
    assert commands[0] == commands[1] == [2, 2], "one GET and the LRU touch per shard"


def test_a_load_in_any_order_with_gaps_and_repeats_is_exact(tier: tuple[str, ObjectStore]) -> None:
    """Runs of objects are found whatever the order asked; a gap splits a run; an object asked twice is read twice."""
    _, store = tier
    oids = ids("order", 10)
    assert store.store(oids, [memoryview(payload(o)) for o in oids]).stored == [True] * 10
    asked = [oids[i] for i in (7, 2, 3, 9, 0, 3, 8, 1)]  # (5 and 6 left out; 3 twice)
    dests = [bytearray(4096) for _ in asked]
    assert store.load(asked, [memoryview(d) for d in dests]) == [True] * len(asked)
    assert [bytes(d) for d in dests] == [payload(o) for o in asked]


def test_a_read_only_buffer_is_a_miss_not_an_error(tier: tuple[str, ObjectStore]) -> None:
    _, store = tier
    [oid] = ids("ro", 1)
    assert store.store([oid], [memoryview(payload(oid))]).stored == [True]
    assert store.load([oid], [memoryview(bytes(4096))]) == [False]
    dest = bytearray(4096)
    assert store.load([oid], [memoryview(dest)]) == [True] and bytes(dest) == payload(oid)


def test_run_digests_follow_object_boundaries_whatever_the_updates() -> None:
    """Each object's checksum is taken while its bytes land, however the tier splits them; an object whose bytes
    were not all seen has none (the load then hashes it itself)."""
    import random

    import xxhash

    from range_connector.lmcache.objects import _RunDigests

    sizes = [5, 0, 4096, 1, 300]
    data = bytes(random.Random(1).randbytes(sum(sizes)))
    for step in (1, 7, 4096, len(data)):
        run = _RunDigests(sizes)
        for pos in range(0, len(data), step):
            run.update(memoryview(data)[pos:pos + step])
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        assert [run.digest_of(k) for k in range(len(sizes))] == [
            xxhash.xxh3_64_intdigest(data[o:o + n]) for o, n in zip(offsets, sizes)]
    partial = _RunDigests(sizes)
    partial.update(data[:100])
    assert [partial.digest_of(k) is None for k in range(len(sizes))] == [False, False, True, True, True]


def test_runs_in_the_given_order_equal_the_sorted_runs_whatever_the_order() -> None:
    """Objects asked for in their stored order are grouped in one pass; any other order (shuffled, a stripe coming
    back, repeats, gaps) gives the same runs as sorting by stripe and offset: each run lies end to end in one stripe,
    in offset order, and every wanted object is in exactly one run."""
    import random

    from range_connector.kv.tickets import Ticket
    from range_connector.lmcache.objects import _contiguous_runs

    sizes = [4096] * 6 + [8192] * 4  # stripe "a": 6 objects, stripe "b": 4
    tickets: list[Ticket | None] = []
    for stripe, n, size in (("a", 6, 4096), ("b", 4, 8192)):
        tickets += [Ticket(stripe, k * size, size, n * size, 1, 1, 1, (0,)) for k in range(n)]

    def canonical(runs: list[list[int]]) -> list[tuple[int, ...]]:
        return sorted(tuple(r) for r in runs)

    in_order = _contiguous_runs(list(range(10)), tickets)
    assert canonical(in_order) == [(0, 1, 2, 3, 4, 5), (6, 7, 8, 9)]
    rng = random.Random(3)
    for wanted in ([6, 7, 8, 9, 0, 1, 2, 3, 4, 5], [0, 1, 6, 7, 2, 3], [0, 1, 3, 4], [2, 2, 3], [5, 4, 3],
                   *[rng.sample(range(10), 10) for _ in range(5)]):
        runs = _contiguous_runs(wanted, tickets)
        assert sorted(j for r in runs for j in r) == sorted(wanted), wanted
        for run in runs:
            first = tickets[run[0]]
            assert first is not None
            assert all(tickets[j].stripe_id == first.stripe_id for j in run)  # type: ignore[union-attr]
            assert [tickets[j].block_offset for j in run] == [  # type: ignore[union-attr]
                first.block_offset + sum(sizes[k] for k in run[:m]) for m in range(len(run))]
    assert canonical(_contiguous_runs([6, 7, 8, 9, 0, 1, 2, 3, 4, 5], tickets)) == canonical(in_order)
    assert canonical(_contiguous_runs([0, 1, 3, 4], tickets)) == [(0, 1), (3, 4)]
    assert canonical(_contiguous_runs([2, 2, 3], tickets)) == [(2,), (2, 3)]
    assert canonical(_contiguous_runs([5, 4, 3], tickets)) == [(3, 4, 5)]
    assert canonical(_contiguous_runs([0, 1, 6, 7, 2, 3], tickets)) == [(0, 1, 2, 3), (6, 7)]


def test_a_large_load_is_split_into_groups_of_about_equal_bytes() -> None:
    """Each read goes to exactly one group, each group keeps the reads' order, and the groups' bytes differ by at
    most the largest read; one group when asked for one, or for a single read."""
    from range_connector.backends.base import RangeRead
    from range_connector.lmcache.objects import _split_reads

    def reads(sizes: list[int]) -> list[RangeRead]:
        return [RangeRead(f"s{i}", 0, 0, n, n, memoryview(bytearray(0))) for i, n in enumerate(sizes)]

    for sizes in ([256, 256], [256, 100], [10, 20, 30, 40, 50], [5] * 7):
        groups = _split_reads(reads(sizes), 2)
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        assert all(g == sorted(g) and g for g in groups) and len(groups) == 2
        totals = [sum(sizes[i] for i in g) for g in groups]
        assert max(totals) - min(totals) <= max(sizes)
    assert _split_reads(reads([256, 256]), 1) == [[0, 1]]
    assert _split_reads(reads([256]), 2) == [[0]]
