"""Conformance suite of the stripe-store protocol (``range_connector.backends.base``), run against every backend.

:class:`TestStripeStoreContract` holds the contract and runs once per backend through the ``store`` fixture
(``memory``: :class:`MemoryBackend`, the reference; ``latency``: the reference behind the latency-injecting wrapper;
``file``; ``valkey``: :class:`ValkeyBackend` on a real server, flushed around every test). A :class:`Store` wraps
what is backend-specific: building backends (with a byte budget, or with a lowered value limit), the server-side
command counts (Valkey ``INFO commandstats``; none for memory), the leases the tier still holds, and an audit of the
tier's own byte accounting. :class:`TestValkeyFailures` covers deadlines
and failures that only a remote tier has.

The Valkey tier runs twice: ``valkey`` (database 0: the bulk data path through our own RESP connection) and
``valkey-db1`` (database 1: everything through valkey-py). Cases (``/work/shared/cases/README.md``): C15, C16, C19,
C21, C27.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgpack
import pytest
import valkey
import xxhash

from range_connector.backends.base import Backend, RangeRead, ScatterDest, StripeWrite
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.latency import LatencyBackend, LatencyControl, TierLatency
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket, ticket_key
from range_connector.worker.direct_receive import WriteGate

MiB = 1 << 20
SERVER_LIMIT_BYTES = 1 * MiB  # the smallest proto-max-bulk-len Valkey accepts
# Server-side commands that are not the call being measured: the measuring's own INFO, and the handshake of a fresh
# connection (it introduces itself and selects its database).
_MEASURING_COMMANDS = ("info", "client", "hello", "ping", "select")


# ---------------------------------------------------------------------------------------------------- stripes
@dataclass
class Stripe:
    """One stripe as a writer builds it: the write, its tickets and the bytes of every layer."""

    write: StripeWrite
    tickets: list[Ticket]
    values: list[bytes]

    @property
    def sid(self) -> str:
        return self.write.stripe_id

    @property
    def keys(self) -> list[bytes]:
        return [k for k, _ in self.write.tickets]

    @property
    def encoded(self) -> list[bytes]:
        return [raw for _, raw in self.write.tickets]

    @property
    def layer_bytes(self) -> int:
        return len(self.values[0])

    @property
    def nbytes(self) -> int:
        return self.write.nbytes


def make_stripe(
    seed: int,
    *,
    num_layers: int = 2,
    num_chunks: int = 2,
    blocks_per_chunk: int = 2,
    num_planes: int = 2,
    row_bytes: int = 125,
    keys: Sequence[bytes] | None = None,
) -> Stripe:
    """A stripe of ``num_chunks`` chunks: ``num_layers`` values of ``num_planes * stripe_blocks * row_bytes`` random
    bytes, one ticket per chunk (keys derived from the stripe id unless given)."""
    sid = uuid.uuid4().hex
    stripe_blocks = num_chunks * blocks_per_chunk
    layer_bytes = num_planes * stripe_blocks * row_bytes
    rng = random.Random(seed)
    values = [rng.randbytes(layer_bytes) for _ in range(num_layers)]
    tickets = [  # checksums are 64-bit like xxh3's (msgpack uint64: the eviction script must still read them)
        Ticket(sid, c * blocks_per_chunk, blocks_per_chunk, stripe_blocks, num_layers, num_planes, row_bytes,
               tuple(rng.getrandbits(64) | 1 << 63 for _ in range(num_layers)))
        for c in range(num_chunks)
    ]
    if keys is None:
        keys = [ticket_key(ChunkHash(hashlib.sha256(b"%s:%d" % (sid.encode(), c)).digest()), 0)
                for c in range(num_chunks)]
    assert len(keys) == num_chunks
    write = StripeWrite(sid, [memoryview(v) for v in values], [(k, t.encode()) for k, t in zip(keys, tickets)])
    return Stripe(write, tickets, values)


def read_whole(backend: Backend, *stripes: Stripe) -> list[list[bytes] | None]:
    """Read every layer of every stripe whole, in one call; ``None`` for a stripe with a missed layer."""
    total = sum(s.nbytes for s in stripes)
    bank = bytearray(total)
    view = memoryview(bank)
    reads, pos = [], 0
    for s in stripes:
        for layer_idx in range(len(s.values)):
            reads.append(RangeRead(s.sid, layer_idx, 0, s.layer_bytes, s.layer_bytes,
                                   view[pos:pos + s.layer_bytes]))
            pos += s.layer_bytes
    ok = backend.read_ranges(reads)
    out: list[list[bytes] | None] = []
    idx = 0
    for s in stripes:
        layers = list(range(idx, idx + len(s.values)))
        idx += len(s.values)
        out.append([bytes(reads[i].dest) for i in layers] if all(ok[i] for i in layers) else None)
    return out


def is_stored(backend: Backend, stripe: Stripe) -> bool:
    """Whether a stripe is stored intact: every layer reads back byte-exact (a read is a use: it refreshes LRU)."""
    got = read_whole(backend, stripe)[0]
    if got is not None:
        assert got == stripe.values, f"stripe {stripe.sid} read back different bytes"
    return got is not None


def _delta(backend: Backend, before: dict[str, int]) -> dict[str, int]:
    after = backend.counters.snapshot()
    return {name: after[name] - before[name] for name in after}


# ---------------------------------------------------------------------------------------------------- stores
class Store:
    """What the contract needs to know about one kind of backend."""

    kind: str

    def make(self, capacity_bytes: int | None = None) -> Backend:
        """An empty backend (closed at teardown)."""
        raise NotImplementedError

    def make_limited(self) -> Backend:
        """An empty backend whose ``max_value_bytes`` is small (about 1 MiB)."""
        raise NotImplementedError

    def server_calls(self) -> dict[str, int]:
        """Cumulative server-side command counts (empty for an in-process tier)."""
        return {}

    def leases_held(self, backend: Backend) -> int:
        """Leases the tier still holds."""
        raise NotImplementedError

    def audit(self, backend: Backend) -> None:
        """Check the tier's own bookkeeping: the byte count equals the bytes of the stripes it lists, every stored
        layer value and every ticket belongs to a listed stripe (nothing orphaned, no ticket of an evicted stripe)."""
        raise NotImplementedError


def server_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Server-side commands run between two :meth:`Store.server_calls` snapshots, without the measuring's own."""
    out = {}
    for name, calls in after.items():
        if name.startswith(_MEASURING_COMMANDS):
            continue
        if calls - before.get(name, 0):
            out[name] = calls - before.get(name, 0)
    return out


class MemoryStore(Store):
    kind = "memory"

    def make(self, capacity_bytes: int | None = None) -> Backend:
        return MemoryBackend(capacity_bytes)

    def make_limited(self) -> Backend:
        return MemoryBackend(None, max_value_bytes=SERVER_LIMIT_BYTES - 1024)

    def leases_held(self, backend: Backend) -> int:
        assert isinstance(backend, MemoryBackend)
        return backend.num_leases()

    def audit(self, backend: Backend) -> None:
        assert isinstance(backend, MemoryBackend)
        with backend._lock:
            stripes = dict(backend._stripes)
            tickets = dict(backend._tickets)
            used = backend._used_bytes
        assert used == sum(len(v) for values in stripes.values() for v in values)
        assert {sid for sid, _ in tickets.values()} <= set(stripes)
        if backend.capacity_bytes is not None:
            assert used <= backend.capacity_bytes


class LatencyStore(MemoryStore):
    """The DRAM tier behind the latency-injecting wrapper, slowed a little (1 ms per round trip, 2 GiB/s) so that
    the contract is checked with the wrapper's waits and link accounting in the path."""

    kind = "latency"

    def __init__(self) -> None:
        self.control = LatencyControl(TierLatency(delay_s=0.001, bandwidth_bytes_per_s=2 * 1024 * MiB))

    def make(self, capacity_bytes: int | None = None) -> Backend:
        return LatencyBackend(super().make(capacity_bytes), self.control, timeout_s=5.0)

    def make_limited(self) -> Backend:
        return LatencyBackend(super().make_limited(), self.control, timeout_s=5.0)

    def leases_held(self, backend: Backend) -> int:
        assert isinstance(backend, LatencyBackend)
        return super().leases_held(backend.inner)

    def audit(self, backend: Backend) -> None:
        assert isinstance(backend, LatencyBackend)
        super().audit(backend.inner)


class ValkeyStore(Store):
    kind = "valkey"

    def __init__(self, url: str, request: pytest.FixtureRequest, db: int = 0) -> None:
        self.server_url = url
        self.db = db
        self.url = url if db == 0 else f"{url}/{db}"
        self._request = request
        self._commandstats: Callable[[str], dict[str, int]] = request.getfixturevalue("server_commandstats")
        self._admin = valkey.Valkey.from_url(self.url, socket_timeout=5.0)
        self._backends: list[Backend] = []
        self._limited_admin: valkey.Valkey | None = None

    def make(self, capacity_bytes: int | None = None) -> Backend:
        b = ValkeyBackend(self.url, timeout_s=5.0, capacity_bytes=capacity_bytes)
        self._backends.append(b)
        return b

    def make_limited(self) -> Backend:
        # A server of its own with a lowered proto-max-bulk-len: the backend reads the limit at start-up.
        url = self._request.getfixturevalue("dedicated_valkey").urls[0]
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        admin.config_set("proto-max-bulk-len", SERVER_LIMIT_BYTES)
        admin.close()
        b = ValkeyBackend(url if self.db == 0 else f"{url}/{self.db}", timeout_s=5.0)
        self._backends.append(b)
        return b

    def server_calls(self) -> dict[str, int]:
        return self._commandstats(self.server_url)

    def leases_held(self, backend: Backend) -> int:
        return sum(self._admin.hlen(k) for k in self._admin.scan_iter(match=b"rc2:l:*", count=1000))

    def audit(self, backend: Backend) -> None:
        audit_valkey(self._admin)
        if backend.capacity_bytes is not None:
            assert backend.used_bytes() <= backend.capacity_bytes

    def close(self) -> None:
        for b in self._backends:
            b.close()
        self._admin.flushdb()
        self._admin.close()


def audit_valkey(admin: valkey.Valkey) -> None:
    """The Valkey tier's bookkeeping (see :meth:`Store.audit`)."""
    keys = [k.decode() for k in admin.scan_iter(match=b"rc2:*", count=1000)]
    manifests = {k.removeprefix("rc2:m:"): msgpack.unpackb(admin.get(k)) for k in keys if k.startswith("rc2:m:")}
    lru = {m.decode() for m in admin.zrange("rc2:lru", 0, -1)}
    used = int(admin.get("rc2:used") or 0)
    assert used == sum(m[0] for m in manifests.values()), (used, manifests)
    assert set(manifests) == lru
    for k in keys:
        if k.startswith("rc2:s:"):
            _, _, sid, layer = k.split(":")
            assert sid in manifests and int(layer) < manifests[sid][1], f"orphaned layer value {k}"
        elif k.startswith("rc2:t:"):
            sid = msgpack.unpackb(admin.get(k))[1]
            assert sid in manifests, f"ticket {k} points at stripe {sid}, which is gone"


class FileStore(Store):
    kind = "file"

    def __init__(self, root) -> None:
        self.root = root
        self._backends: list[Backend] = []

    def make(self, capacity_bytes: int | None = None) -> Backend:
        b = FileBackend(self.root / "shard", capacity_bytes, timeout_s=5.0)
        self._backends.append(b)
        return b

    def make_limited(self) -> Backend:
        b = FileBackend(self.root / "limited", timeout_s=5.0, max_value_bytes=SERVER_LIMIT_BYTES - 1024)
        self._backends.append(b)
        return b

    def leases_held(self, backend: Backend) -> int:
        assert isinstance(backend, FileBackend)
        return backend.num_leases()

    def audit(self, backend: Backend) -> None:
        assert isinstance(backend, FileBackend)
        stripes = {p.name: p.stat().st_size for p in (backend.root / "stripes").iterdir()}
        assert not [name for name in stripes if not name.isalnum()], stripes  # no temp file left behind
        assert backend.used_bytes() == sum(size - 4096 for size in stripes.values())
        fresh = FileBackend(backend.root)  # the ticket log replayed from scratch
        fresh.get_tickets([])
        assert {sid for sid, _ in fresh._log.tickets.values()} <= set(stripes)
        fresh.close()
        if backend.capacity_bytes is not None:
            assert backend.used_bytes() <= backend.capacity_bytes

    def close(self) -> None:
        for b in self._backends:
            b.close()


@pytest.fixture(params=["memory", "latency", "file", "valkey", "valkey-db1"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "latency":
        yield LatencyStore()
        return
    if request.param == "file":
        s = FileStore(tmp_path)
        try:
            yield s
        finally:
            s.close()
        return
    url = request.getfixturevalue("valkey_servers").urls[0]
    s = ValkeyStore(url, request, db=1 if request.param == "valkey-db1" else 0)
    s._admin.flushdb()
    try:
        yield s
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------------- contract
class TestStripeStoreContract:
    """The stripe-store contract (module docstring of ``range_connector.backends.base``), for every backend."""

    # ------------------------------------------------------------------ write, then read ranges
    @pytest.mark.timeout(20)
    def test_write_then_read_ranges_is_byte_exact(self, store: Store) -> None:
        b = store.make()
        stripes = [make_stripe(seed, num_layers=3, num_chunks=3, row_bytes=1001 + seed) for seed in range(3)]
        for s in stripes:
            assert b.write_stripe(s.write) is True
        # (stripe, layer, offset, length): whole values, odd offsets and lengths, first and last byte, sub-ranges.
        wanted = []
        for i, s in enumerate(stripes):
            n = s.layer_bytes
            wanted += [(i, 0, 0, n), (i, 1, 1, n - 2), (i, 2, 7, 13), (i, 0, n - 1, 1), (i, 2, 0, 1),
                       (i, 1, 3 * 1001 + 5, 2 * 1001 - 3), (i, 2, n - 777, 777)]
        gap = 3  # bytes between dests that no read may touch
        bank = bytearray(b"\xa5" * (sum(w[3] + gap for w in wanted)))
        view = memoryview(bank)
        reads, pos = [], 0
        for i, layer_idx, offset, length in wanted:
            s = stripes[i]
            reads.append(RangeRead(s.sid, layer_idx, offset, length, s.layer_bytes, view[pos:pos + length]))
            pos += length + gap

        before = b.counters.snapshot()
        ok = b.read_ranges(reads)

        assert ok == [True] * len(reads)
        assert _delta(b, before)["round_trips"] == 1
        pos = 0
        for (i, layer_idx, offset, length), r in zip(wanted, reads):
            assert bank[pos:pos + length] == stripes[i].values[layer_idx][offset:offset + length]
            assert bank[pos + length:pos + length + gap] == b"\xa5" * gap
            pos += length + gap

    @pytest.mark.timeout(10)
    def test_buffers_of_any_format_are_stored_as_raw_bytes(self, store: Store) -> None:
        import numpy as np

        b = store.make()
        a = np.arange(64, dtype=np.int64)
        planes = np.arange(2 * 128, dtype=np.uint16).reshape(2, 128)
        sid = uuid.uuid4().hex
        write = StripeWrite(sid, [memoryview(a), memoryview(planes), bytearray(a.tobytes())], [])
        assert b.write_stripe(write) is True
        dests = [bytearray(512) for _ in range(3)]
        assert b.read_ranges([RangeRead(sid, i, 0, 512, 512, memoryview(d)) for i, d in enumerate(dests)]) == [True] * 3
        assert [bytes(d) for d in dests] == [a.tobytes(), planes.tobytes(), a.tobytes()]

    @pytest.mark.timeout(10)
    def test_stripe_never_written_reads_false_and_leaves_dest_untouched(self, store: Store) -> None:
        b = store.make()
        s = make_stripe(1)
        assert b.write_stripe(s.write) is True
        n = s.layer_bytes
        dests = [bytearray(b"\x5a" * length) for length in (n, 10, n, 10, 10)]
        reads = [
            RangeRead(uuid.uuid4().hex, 0, 0, n, n, memoryview(dests[0])),  # whole value of an unknown stripe
            RangeRead(uuid.uuid4().hex, 1, 5, 10, n, memoryview(dests[1])),  # sub-range of an unknown stripe
            RangeRead(s.sid, 1, 0, n, n, memoryview(dests[2])),  # present
            RangeRead(s.sid, 7, 0, 10, n, memoryview(dests[3])),  # a layer the stripe does not have
            RangeRead(s.sid, 0, 20, 10, n, memoryview(dests[4])),  # present
        ]

        before = b.counters.snapshot()
        ok = b.read_ranges(reads)

        assert ok == [False, False, True, False, True]
        assert _delta(b, before)["round_trips"] == 1
        assert bytes(dests[0]) == b"\x5a" * n and bytes(dests[1]) == b"\x5a" * 10 and bytes(dests[3]) == b"\x5a" * 10
        assert bytes(dests[2]) == s.values[1] and bytes(dests[4]) == s.values[0][20:30]
        assert b.read_ranges([]) == []

    @pytest.mark.timeout(10)
    def test_scatter_reads_land_in_their_pieces_and_a_closed_gate_stops_them(self, store: Store) -> None:
        b = store.make()
        if not b.supports_scatter:
            pytest.skip(f"the {store.kind} tier has no scatter reads (loads from it stage through transfer banks)")
        s = make_stripe(2)
        assert b.write_stripe(s.write) is True
        n = s.layer_bytes
        buf = bytearray(b"\x5a" * (n + 20))
        view = memoryview(buf)
        whole = (view[600:n], view[0:1], view[1:600])  # layer 0, in pieces placed out of order
        part = (view[n + 3:n + 10], view[n:n + 3])  # bytes [333, 343) of layer 1
        miss = (view[n + 10:n + 20],)
        gate = WriteGate()
        digest = xxhash.xxh3_64()
        reads = [RangeRead(s.sid, 0, 0, n, n, ScatterDest(whole, gate, digest)),
                 RangeRead(s.sid, 1, 333, 10, n, ScatterDest(part, gate)),
                 RangeRead(uuid.uuid4().hex, 0, 0, 10, n, ScatterDest(miss, gate))]

        before = b.counters.snapshot()
        assert b.read_ranges(reads) == [True, True, False]

        assert _delta(b, before)["round_trips"] == 1
        assert b"".join(bytes(p) for p in whole) == s.values[0]
        assert digest.intdigest() == xxhash.xxh3_64_intdigest(s.values[0])  # updated as the bytes landed
        assert b"".join(bytes(p) for p in part) == s.values[1][333:343]
        assert bytes(miss[0]) == b"\x5a" * 10
        gate.close()  # the owner of the pieces is gone: the next read raises and writes nothing
        fresh = bytearray(b"\x5a" * n)
        with pytest.raises(BackendError, match="cancelled"):
            b.read_ranges([RangeRead(s.sid, 0, 0, n, n, ScatterDest((memoryview(fresh),), gate))])
        assert fresh == b"\x5a" * n
        assert is_stored(b, s)  # and the tier serves the next read

    @pytest.mark.timeout(10)
    @pytest.mark.parametrize(
        ("offset", "length", "value_bytes"),
        [
            (-1, 10, None),  # negative offset
            (-20, 10, None),  # negative offset that GETRANGE would count from the end
            (0, 0, None),  # an empty read
            ("end-5", 10, None),  # runs past the end of the value
            ("end", 10, None),  # starts at the end of the value
            ("end+100", 10, "end+200"),  # beyond the stored value, inside what the (lying) ticket claims
            (0, "end+1", "end+1"),  # a whole-value read of a value shorter than the ticket claims
            (10, 20, 25),  # outside the value size the ticket gives
        ],
    )
    def test_read_outside_the_value_raises_value_error(self, store: Store, offset, length, value_bytes) -> None:
        b = store.make()
        s = make_stripe(2)
        assert b.write_stripe(s.write) is True
        n = s.layer_bytes

        def resolve(x):
            if isinstance(x, str):
                return n + (int(x[3:]) if len(x) > 3 else 0)
            return x

        offset, length = resolve(offset), resolve(length)
        value_bytes = n if value_bytes is None else resolve(value_bytes)
        dest = memoryview(bytearray(max(0, length)))

        read = RangeRead(s.sid, 0, offset, length, value_bytes, dest)
        if store.kind == "valkey" and offset >= n and value_bytes > n:
            # Valkey's GETRANGE answers "" both for a missing key and for a range past the end of a value: a range
            # entirely past the end of a value shorter than its ticket claims reads as a miss. Never as a hit.
            try:
                assert b.read_ranges([read]) == [False]
            except ValueError:
                pass
        else:
            with pytest.raises(ValueError):
                b.read_ranges([read])

        # The backend (and its connections) stay usable.
        assert read_whole(b, s) == [s.values]

    @pytest.mark.timeout(10)
    def test_views_of_stripes_are_byte_exact_and_outlive_eviction(self, store: Store) -> None:
        b = store.make(capacity_bytes=make_stripe(0).nbytes)
        if not b.supports_views:
            with pytest.raises(NotImplementedError):
                b.view_stripes(["x"])
            return
        (a,) = self._fill(b, 1)
        before = b.counters.snapshot()
        views = b.view_stripes([a.sid, uuid.uuid4().hex])
        assert _delta(b, before)["round_trips"] == 1
        assert views[1] is None and [bytes(v) for v in views[0]] == a.values
        assert all(v.readonly for v in views[0])
        assert b.write_stripe(make_stripe(1).write) is True  # evicts a: the lent views stay valid
        assert b.view_stripes([a.sid]) == [None]
        assert [bytes(v) for v in views[0]] == a.values

    # ------------------------------------------------------------------ tickets
    @pytest.mark.timeout(30)
    @pytest.mark.parametrize("num_keys", [1, 10, 1000])
    def test_get_tickets_is_one_round_trip_and_one_command(self, store: Store, num_keys: int) -> None:
        b = store.make()
        s = make_stripe(3, num_chunks=num_keys, blocks_per_chunk=1, row_bytes=8)
        assert b.write_stripe(s.write) is True
        missing = [b"rc2:t:%064x:s0:r0" % i for i in range(num_keys // 2)]
        keys = s.keys[: num_keys - len(missing)] + missing
        random.Random(num_keys).shuffle(keys)
        expected = {k: raw for k, raw in s.write.tickets}

        server_before = store.server_calls()
        before = b.counters.snapshot()
        got = b.get_tickets(keys)
        delta = _delta(b, before)
        server = server_delta(server_before, store.server_calls())

        assert got == [expected.get(k) for k in keys]
        assert delta["round_trips"] == 1 and delta["commands"] == 1
        if store.kind == "valkey":
            assert server == {"mget": 1}
        assert b.get_tickets(missing or [b"rc2:t:none"]) == [None] * max(1, len(missing))
        assert b.get_tickets([]) == []
        assert all(Ticket.decode(raw, num_layers=2, layer_block_bytes=16, num_blocks=1) == t
                   for raw, t in zip(b.get_tickets(s.keys[:5]), s.tickets))

    # ------------------------------------------------------------------ cost follows bytes (DESIGN.md §3.1)
    @pytest.mark.timeout(60)
    def test_cost_follows_bytes_not_chunks(self, store: Store) -> None:
        # A fixed payload of 8 MiB over 8 layers (1 MiB per layer: 2 planes x 128 blocks x 4 KiB), stored as one
        # stripe of 4 chunks or of 128 chunks. Writing it, looking up its tickets, reading it whole and reading a
        # partial hit (the first half of the chunks) must cost the same round trips, commands, allocations and copy
        # launches, and the same server-side commands: only the ticket MSET/MGET grow in arguments, not in number.
        b = store.make()
        num_layers, num_planes, stripe_blocks, row_bytes = 8, 2, 128, 4096
        costs = {}
        for num_chunks in (4, 128):
            s = make_stripe(num_chunks, num_layers=num_layers, num_chunks=num_chunks,
                            blocks_per_chunk=stripe_blocks // num_chunks, num_planes=num_planes, row_bytes=row_bytes)
            assert s.nbytes == 8 * MiB
            bank = bytearray(8 * MiB)
            view = memoryview(bank)
            whole = [RangeRead(s.sid, layer, 0, MiB, MiB, view[layer * MiB:(layer + 1) * MiB])
                     for layer in range(num_layers)]
            half = stripe_blocks // 2 * row_bytes
            partial = [RangeRead(s.sid, layer, p * stripe_blocks * row_bytes, half, MiB,
                                 view[(layer * num_planes + p) * half:(layer * num_planes + p + 1) * half])
                       for layer in range(num_layers) for p in range(num_planes)]
            phases = {
                "write": lambda: b.write_stripe(s.write),
                "lookup": lambda: b.get_tickets(s.keys),
                "read_whole": lambda: b.read_ranges(whole),
                "read_partial": lambda: b.read_ranges(partial),
            }
            costs[num_chunks] = {}
            for phase, call in phases.items():
                server_before = store.server_calls()
                before = b.counters.snapshot()
                result = call()
                costs[num_chunks][phase] = (_delta(b, before), server_delta(server_before, store.server_calls()))
                if phase == "write":
                    assert result is True
                elif phase == "lookup":
                    assert result == s.encoded
                elif phase == "read_whole":
                    assert result == [True] * num_layers
                    assert [bytes(r.dest) for r in whole] == s.values
                else:
                    assert result == [True] * (num_layers * num_planes)
                    for r in partial:
                        assert bytes(r.dest) == s.values[r.layer_idx][r.offset:r.offset + half]

        for phase in costs[4]:
            client4, server4 = costs[4][phase]
            client128, server128 = costs[128][phase]
            assert client4 == client128, (phase, client4, client128)
            assert server4 == server128, (phase, server4, server128)
            if phase != "write":
                assert client4["round_trips"] == 1, (phase, client4)
        assert costs[4]["write"][0]["round_trips"] <= 2
        assert costs[4]["write"][0]["bytes_written"] == 8 * MiB
        assert costs[4]["read_whole"][0]["bytes_read"] == 8 * MiB
        if store.kind == "valkey":
            write, lookup = costs[4]["write"][1], costs[4]["lookup"][1]
            assert write["mset"] == 1 and num_layers <= write["set"] <= num_layers + 1
            assert lookup == {"mget": 1}
            assert costs[4]["read_whole"][1].get("get") == num_layers
            assert "getrange" not in costs[4]["read_whole"][1]  # whole values are read with GET
            assert costs[4]["read_partial"][1].get("getrange") == num_layers * num_planes

    # ------------------------------------------------------------------ capacity and leases
    @staticmethod
    def _fill(b: Backend, n: int, seed: int = 100) -> list[Stripe]:
        stripes = [make_stripe(seed + i) for i in range(n)]
        for s in stripes:
            assert b.write_stripe(s.write) is True
        return stripes

    @pytest.mark.timeout(20)
    def test_capacity_evicts_least_recently_used_stripes_with_their_tickets(self, store: Store) -> None:
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=3 * stripe_bytes + stripe_bytes // 2)
        a, bb, c = self._fill(b, 3)
        assert b.used_bytes() == 3 * stripe_bytes
        assert is_stored(b, a)  # a read is a use: now bb is the least recently used

        d = make_stripe(9)
        assert b.write_stripe(d.write) is True

        assert b.get_tickets(bb.keys) == [None] * len(bb.keys)
        assert read_whole(b, bb) == [None]
        for s in (a, c, d):  # read in this order: a is the least recently used afterwards
            assert b.get_tickets(s.keys) == s.encoded
            assert is_stored(b, s)
        assert b.used_bytes() == 3 * stripe_bytes
        b.lease([a.sid], ttl_s=30)  # a lease is a use too: now c is the least recently used
        b.release([a.sid])
        e = make_stripe(10)
        assert b.write_stripe(e.write) is True
        assert b.get_tickets(c.keys) == [None] * len(c.keys)
        assert [is_stored(b, s) for s in (a, c, d, e)] == [True, False, True, True]
        assert b.used_bytes() <= b.capacity_bytes
        store.audit(b)

    @pytest.mark.timeout(20)
    def test_leased_stripe_is_never_evicted_until_released(self, store: Store) -> None:
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=2 * stripe_bytes)
        a, bb = self._fill(b, 2)
        b.lease([a.sid, bb.sid], ttl_s=30)

        c = make_stripe(7)
        assert b.write_stripe(c.write) is False  # everything evictable is leased: the write is skipped

        assert b.get_tickets(c.keys) == [None] * len(c.keys)
        assert read_whole(b, c) == [None]
        assert read_whole(b, a, bb) == [a.values, bb.values]
        assert b.used_bytes() == 2 * stripe_bytes
        store.audit(b)

        b.release([a.sid])
        assert b.write_stripe(c.write) is True
        assert b.get_tickets(a.keys) == [None] * len(a.keys)
        assert read_whole(b, a, bb, c) == [None, bb.values, c.values]
        b.release([bb.sid])
        assert store.leases_held(b) == 0
        store.audit(b)

    @pytest.mark.timeout(20)
    def test_expired_lease_protects_nothing(self, store: Store) -> None:
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=2 * stripe_bytes)
        a, bb = self._fill(b, 2)
        b.lease([a.sid, bb.sid], ttl_s=0.3)
        c = make_stripe(7)
        assert b.write_stripe(c.write) is False

        time.sleep(0.45)

        assert store.leases_held(b) == 0
        assert b.write_stripe(c.write) is True
        got = read_whole(b, a, bb, c)  # a and bb were used together (one lease call): either may go first
        assert got[2] == c.values and sorted([got[0] is None, got[1] is None]) == [False, True]
        assert got[0] in (None, a.values) and got[1] in (None, bb.values)
        b.release([a.sid, bb.sid])  # releasing expired leases (one of a stripe that is gone) is harmless
        assert store.leases_held(b) == 0
        store.audit(b)

    @pytest.mark.timeout(20)
    def test_leases_are_counted(self, store: Store) -> None:
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=stripe_bytes)
        (a,) = self._fill(b, 1)
        b.lease([a.sid], ttl_s=30)
        b.lease([a.sid], ttl_s=30)
        c = make_stripe(7)

        b.release([a.sid])
        assert b.write_stripe(c.write) is False  # one lease is still held
        assert is_stored(b, a)

        b.release([a.sid])
        assert store.leases_held(b) == 0
        assert b.write_stripe(c.write) is True
        assert read_whole(b, a, c) == [None, c.values]
        b.release([a.sid, c.sid, "neverleased"])  # more releases than leases are harmless
        assert store.leases_held(b) == 0
        store.audit(b)

    @pytest.mark.timeout(20)
    def test_short_lease_does_not_cut_a_longer_one(self, store: Store) -> None:
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=stripe_bytes)
        (a,) = self._fill(b, 1)
        b.lease([a.sid], ttl_s=30)  # the load that needs it for a while
        b.lease([a.sid], ttl_s=0.2)  # another holder, briefly
        time.sleep(0.35)

        c = make_stripe(7)
        assert b.write_stripe(c.write) is False  # the 30 s lease still protects it
        assert is_stored(b, a)
        b.release([a.sid])
        b.release([a.sid])
        assert store.leases_held(b) == 0
        assert b.write_stripe(c.write) is True

    @pytest.mark.timeout(20)
    def test_ticket_repointed_to_a_newer_stripe_survives_eviction_of_the_older(self, store: Store) -> None:
        stripe_bytes = make_stripe(0, num_chunks=3).nbytes
        b = store.make(capacity_bytes=2 * stripe_bytes)
        old = make_stripe(1, num_chunks=3)
        new = make_stripe(2, num_chunks=3, keys=[old.keys[1], old.keys[2], b"rc2:t:%064x:s0:r0" % 7])
        assert b.write_stripe(old.write) is True
        assert b.write_stripe(new.write) is True
        assert b.get_tickets(old.keys) == [old.encoded[0], new.encoded[0], new.encoded[1]]

        assert b.write_stripe(make_stripe(3, num_chunks=3).write) is True  # evicts old, the least recently used

        assert read_whole(b, old, new) == [None, new.values]
        assert b.get_tickets(old.keys + new.keys[2:]) == [None, new.encoded[0], new.encoded[1], new.encoded[2]]
        store.audit(b)

    @pytest.mark.timeout(20)
    def test_stripe_larger_than_the_budget_is_skipped(self, store: Store) -> None:
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=2 * stripe_bytes)
        (a,) = self._fill(b, 1)
        big = make_stripe(5, num_chunks=6)
        assert big.nbytes > 2 * stripe_bytes

        assert b.write_stripe(big.write) is False

        assert b.get_tickets(big.keys) == [None] * len(big.keys)
        assert is_stored(b, a)  # nothing was evicted for a write that could never fit
        assert b.used_bytes() == stripe_bytes
        store.audit(b)

    @pytest.mark.timeout(40)
    def test_case_C15_sustained_eviction_keeps_promised_stripes_until_released(self, store: Store) -> None:
        # Working set far larger than the tier: two writers keep saving while a scheduler looks up older stripes,
        # leases what it finds (the promise), loads it a few times and releases it. A stripe that was still listed
        # after its lease was taken must stay readable, byte-exact, until it is released.
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=6 * stripe_bytes)
        written: list[Stripe] = []
        written_lock = threading.Lock()
        errors: list[str] = []
        writers_done = threading.Event()
        stats = {"promised": 0, "gone_before_lease": 0, "skipped_writes": 0}

        def writer(w: int) -> None:
            try:
                for i in range(40):
                    s = make_stripe(1000 * w + i)
                    if b.write_stripe(s.write):
                        with written_lock:
                            written.append(s)
                    else:
                        stats["skipped_writes"] += 1
                    used = b.used_bytes()
                    if used > b.capacity_bytes:
                        errors.append(f"used {used} over the budget {b.capacity_bytes}")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"writer {w}: {exc!r}")
            finally:
                if w == 0:
                    writers_done.set()

        def scheduler() -> None:
            rng = random.Random(5)
            try:
                while not writers_done.is_set() or stats["promised"] < 10:
                    with written_lock:
                        candidates = written[-8:]
                    if not candidates:
                        time.sleep(0.001)
                        continue
                    s = rng.choice(candidates)
                    if b.get_tickets(s.keys) != s.encoded:
                        continue  # a miss at lookup: nothing promised
                    b.lease([s.sid], ttl_s=30)
                    try:
                        if b.get_tickets(s.keys) != s.encoded:
                            stats["gone_before_lease"] += 1  # evicted between lookup and lease: a load error
                            continue
                        stats["promised"] += 1
                        for _ in range(3):
                            if not is_stored(b, s):
                                errors.append(f"promised stripe {s.sid} was evicted while leased")
                                break
                            time.sleep(0.002)
                    finally:
                        b.release([s.sid])
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"scheduler: {exc!r}")

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        threads.append(threading.Thread(target=scheduler))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert stats["promised"] >= 10
        assert stats["skipped_writes"] == 0  # at most one stripe is leased at a time: there is always room
        assert len(written) == 80 and b.used_bytes() <= b.capacity_bytes
        assert store.leases_held(b) == 0
        store.audit(b)

    @pytest.mark.timeout(30)
    def test_case_C16_leases_are_released_and_usage_returns_to_the_live_stripes(self, store: Store) -> None:
        # Long traffic in which many promised loads are skipped: leases taken and released on every path, some
        # released twice over, some only after they expired, some of stripes evicted meanwhile. Afterwards no lease
        # remains, and the tier's usage is exactly the bytes of the stripes still stored.
        stripe_bytes = make_stripe(0).nbytes
        b = store.make(capacity_bytes=5 * stripe_bytes)
        rng = random.Random(16)
        stripes: list[Stripe] = []
        expiring: list[str] = []
        for i in range(40):
            s = make_stripe(2000 + i)
            assert b.write_stripe(s.write) is True
            stripes.append(s)
            ids = [x.sid for x in rng.sample(stripes[-4:], min(len(stripes), 2))]
            kind = i % 4
            if kind == 0:  # promised and loaded
                b.lease(ids, ttl_s=30)
                b.release(ids)
            elif kind == 1:  # two holders of the same stripes
                b.lease(ids, ttl_s=30)
                b.lease(ids, ttl_s=30)
                b.release(ids)
                b.release(ids)
            elif kind == 2:  # the promise is skipped and its lease runs out; released late anyway
                b.lease(ids, ttl_s=0.05)
                expiring += ids
                time.sleep(0.06)
            else:  # released although never taken (an error path)
                b.release(ids)
        time.sleep(0.1)
        b.release(expiring)

        assert store.leases_held(b) == 0
        live = [s for s in stripes if is_stored(b, s)]
        assert len(live) == 5
        assert b.used_bytes() == sum(s.nbytes for s in live)
        store.audit(b)
        # Nothing left protects anything: a new working set replaces every stripe.
        fresh = self._fill(b, 5, seed=3000)
        assert not any(is_stored(b, s) for s in live)
        assert b.used_bytes() == sum(s.nbytes for s in fresh)
        store.audit(b)

    # ------------------------------------------------------------------ value limits
    @pytest.mark.timeout(30)
    def test_case_C19_value_over_max_value_bytes_raises_and_stores_nothing(self, store: Store) -> None:
        b = store.make_limited()
        limit = b.max_value_bytes
        assert 0 < limit < SERVER_LIMIT_BYTES
        over = make_stripe(1, num_layers=2, num_chunks=1, blocks_per_chunk=1, num_planes=1, row_bytes=limit + 1)

        with pytest.raises(ValueError, match=str(limit)):
            b.write_stripe(over.write)

        assert b.get_tickets(over.keys) == [None]
        assert read_whole(b, over) == [None]
        assert b.used_bytes() == 0
        # A value of exactly the limit is accepted, and the tier (and its connections) are healthy afterwards.
        edge = make_stripe(2, num_layers=2, num_chunks=1, blocks_per_chunk=1, num_planes=1, row_bytes=limit)
        assert b.write_stripe(edge.write) is True
        assert read_whole(b, edge) == [edge.values]
        small = make_stripe(3)
        assert b.write_stripe(small.write) is True
        assert b.get_tickets(small.keys + edge.keys) == small.encoded + edge.encoded

    @pytest.mark.timeout(10)
    def test_layer_values_of_different_sizes_raise_and_store_nothing(self, store: Store) -> None:
        b = store.make()
        s = make_stripe(1)
        bad = StripeWrite(s.sid, [s.values[0], s.values[1][:-1]], s.write.tickets)
        with pytest.raises(ValueError, match="different sizes"):
            b.write_stripe(bad)
        with pytest.raises(ValueError, match="alphanumeric"):
            b.write_stripe(StripeWrite("not:alnum", s.write.layer_values, s.write.tickets))
        assert b.get_tickets(s.keys) == [None] * len(s.keys)
        assert read_whole(b, s) == [None]
        assert b.used_bytes() == 0

    # ------------------------------------------------------------------ delete
    @pytest.mark.timeout(20)
    def test_case_C27_deleted_tickets_are_not_offered_again(self, store: Store) -> None:
        # The loader found bad bytes behind two chunks and forgets their tickets: a later lookup must not offer the
        # same phantom hit again. The stripe itself stays until it ages out (other chunks still use it).
        stripe_bytes = make_stripe(0, num_chunks=4).nbytes
        b = store.make(capacity_bytes=2 * stripe_bytes)
        s = make_stripe(1, num_chunks=4)
        assert b.write_stripe(s.write) is True

        before = b.counters.snapshot()
        b.delete_tickets([s.keys[1], s.keys[2], b"rc2:t:never"])
        assert _delta(b, before)["round_trips"] == 1

        for _ in range(2):
            assert b.get_tickets(s.keys) == [s.encoded[0], None, None, s.encoded[3]]
        assert is_stored(b, s)
        b.delete_tickets([])
        store.audit(b)
        # Evicting the stripe later copes with the tickets that are already gone.
        for i in range(2):
            assert b.write_stripe(make_stripe(10 + i, num_chunks=4).write) is True
        assert b.get_tickets(s.keys) == [None] * 4
        assert read_whole(b, s) == [None]
        store.audit(b)

    @pytest.mark.timeout(20)
    def test_drop_stripes_removes_bytes_and_tickets_in_one_round_trip(self, store: Store) -> None:
        # range-connector calibrate writes stripes of its own and must leave the tier as it found it.
        b = store.make()
        kept, dropped = make_stripe(1, num_chunks=2), make_stripe(2, num_chunks=3)
        assert b.write_stripe(kept.write) is True
        used_before = b.used_bytes()
        assert b.write_stripe(dropped.write) is True
        assert b.used_bytes() == used_before + dropped.nbytes

        before = b.counters.snapshot()
        b.drop_stripes([dropped.sid, "0123456789abcdef0123456789abcdef"])  # an unknown id is ignored
        assert _delta(b, before)["round_trips"] == 1

        assert b.get_tickets(dropped.keys) == [None] * 3
        assert read_whole(b, dropped) == [None]
        assert b.used_bytes() == used_before
        assert b.get_tickets(kept.keys) == kept.encoded
        assert is_stored(b, kept)
        b.drop_stripes([])
        store.audit(b)

    # ------------------------------------------------------------------ concurrency
    @pytest.mark.timeout(60)
    def test_concurrent_writers_and_readers_are_byte_exact(self, store: Store) -> None:
        b = store.make()
        num_threads, num_rounds = 4, 12
        errors: list[str] = []
        barrier = threading.Barrier(num_threads)

        def work(t: int) -> None:
            try:
                barrier.wait()
                mine: list[Stripe] = []
                for r in range(num_rounds):
                    s = make_stripe(10_000 * t + r, num_layers=3, num_chunks=1 + r % 4, row_bytes=997 + 64 * t)
                    if not b.write_stripe(s.write):
                        errors.append(f"thread {t}: write skipped")
                    mine.append(s)
                    older = mine[r // 2]
                    if b.get_tickets(s.keys + older.keys) != s.encoded + older.encoded:
                        errors.append(f"thread {t}: wrong tickets")
                    if read_whole(b, s, older) != [s.values, older.values]:
                        errors.append(f"thread {t}: round {r} read back wrong bytes")
                    dest = bytearray(101)
                    if b.read_ranges([RangeRead(s.sid, 2, 33, 101, s.layer_bytes, memoryview(dest))]) != [True] \
                            or bytes(dest) != s.values[2][33:134]:
                        errors.append(f"thread {t}: round {r} sub-range wrong")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(f"thread {t}: {exc!r}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=50)
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        # Counters are not lost under concurrency: a round is one write, one lookup and two reads.
        write_trips = 1  # no budget: one round trip per write
        assert b.counters.round_trips == num_threads * num_rounds * (write_trips + 3)
        store.audit(b)

    # ------------------------------------------------------------------ counters
    @pytest.mark.timeout(10)
    def test_counters_count_bytes_written_and_read(self, store: Store) -> None:
        b = store.make()
        s = make_stripe(1, num_layers=3, num_chunks=2, row_bytes=111)  # 3 layers of 888 bytes
        assert b.counters.snapshot() == dict.fromkeys(b.counters.snapshot(), 0)

        before = b.counters.snapshot()
        assert b.write_stripe(s.write) is True
        written = _delta(b, before)
        assert written["bytes_written"] == 3 * 888 and written["bytes_read"] == 0

        before = b.counters.snapshot()
        dests = [memoryview(bytearray(n)) for n in (888, 10, 5, 888)]
        ok = b.read_ranges([
            RangeRead(s.sid, 0, 0, 888, 888, dests[0]),
            RangeRead(s.sid, 1, 100, 10, 888, dests[1]),
            RangeRead(s.sid, 2, 883, 5, 888, dests[2]),
            RangeRead(uuid.uuid4().hex, 0, 0, 888, 888, dests[3]),  # a miss reads nothing
        ])
        read = _delta(b, before)
        assert ok == [True, True, True, False]
        assert read["bytes_read"] == 888 + 10 + 5 and read["bytes_written"] == 0
        assert read["round_trips"] == 1

        snap = b.counters.snapshot()
        b.get_tickets(s.keys)
        assert snap != b.counters.snapshot()  # a snapshot is a copy
        assert set(snap) == {"round_trips", "commands", "bytes_written", "bytes_read", "allocations", "copy_launches"}


# ---------------------------------------------------------------------------------------------------- Valkey only
class _TricklingServer:
    """A fake Valkey server on loopback: it answers the start-up handshake at once, then sends the reply of every
    GET, GETRANGE and MGET one byte per ``interval_s``. It keeps answering, so no single socket read times out, but
    the call as a whole takes ``len(reply) * interval_s``."""

    SLOW_REPLIES = {b"GET": b"$8\r\nslowslow\r\n", b"GETRANGE": b"$8\r\nslowslow\r\n", b"MGET": b"*1\r\n$4\r\nslow\r\n"}

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"valkey://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                header = reader.readline()
                if not header.startswith(b"*"):
                    return
                args = []
                for _ in range(int(header[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                command = args[0].upper()
                if command == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif command == b"CONFIG":
                    conn.sendall(b"*2\r\n$18\r\nproto-max-bulk-len\r\n$9\r\n536870912\r\n")
                elif command in self.SLOW_REPLIES:
                    for byte in self.SLOW_REPLIES[command]:
                        if self._stop.wait(self.interval_s):
                            return
                        conn.sendall(bytes([byte]))
                else:
                    conn.sendall(b"+OK\r\n")
        except (OSError, ValueError):
            return
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=2.0)


def _url_pattern(url: str) -> str:
    """Errors name the server: its URL (valkey-py path) or its address (RESP path)."""
    return re.escape(url.removeprefix("valkey://").split("/")[0])


@pytest.fixture(params=[0, 1], ids=["resp", "valkey-py"])
def db(request: pytest.FixtureRequest) -> int:
    """Database 0 takes the RESP data path; database 1 goes through valkey-py."""
    return request.param


def _db_url(url: str, db: int) -> str:
    return url if db == 0 else f"{url}/{db}"


class TestValkeyFailures:
    """Deadlines and failures of the Valkey tier (each on both data paths)."""

    @pytest.mark.timeout(20)
    def test_max_value_bytes_follows_the_server_limit(self, dedicated_valkey) -> None:
        url = dedicated_valkey.urls[0]
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            default = ValkeyBackend(url, timeout_s=2.0)
            admin.config_set("proto-max-bulk-len", 3 * MiB)
            lowered = ValkeyBackend(url, timeout_s=2.0)
        finally:
            admin.close()
        assert 500 * MiB < default.max_value_bytes < 512 * MiB
        assert 2 * MiB < lowered.max_value_bytes < 3 * MiB
        assert default.name == url and default.is_shared
        default.close()
        lowered.close()

    @pytest.mark.timeout(30)
    def test_frozen_server_raises_timeout_within_the_deadline(self, dedicated_valkey, db: int) -> None:
        url, pid = _db_url(dedicated_valkey.urls[0], db), dedicated_valkey.pids[0]
        timeout_s = 0.5
        s = make_stripe(1)
        b = ValkeyBackend(url, timeout_s=timeout_s)
        budgeted = ValkeyBackend(url, timeout_s=timeout_s, capacity_bytes=100 * s.nbytes)
        assert b.write_stripe(s.write) is True
        n = s.layer_bytes
        calls: list[tuple[str, Callable[[], object]]] = [
            ("get_tickets", lambda: b.get_tickets(s.keys)),
            ("read_ranges", lambda: b.read_ranges([RangeRead(s.sid, 0, 0, n, n, memoryview(bytearray(n)))])),
            ("write_stripe", lambda: b.write_stripe(make_stripe(2).write)),
            ("write_stripe with a budget", lambda: budgeted.write_stripe(make_stripe(3).write)),
            ("lease", lambda: b.lease([s.sid], ttl_s=30)),
            ("release", lambda: b.release([s.sid])),
            ("delete_tickets", lambda: b.delete_tickets(s.keys[:1])),
        ]
        os.kill(pid, signal.SIGSTOP)
        try:
            for name, call in calls:
                start = time.monotonic()
                with pytest.raises(BackendTimeoutError, match=_url_pattern(url)) as exc_info:
                    call()
                elapsed_s = time.monotonic() - start
                assert elapsed_s < timeout_s + 1.0, (name, elapsed_s)
                assert isinstance(exc_info.value, BackendError) and isinstance(exc_info.value, TimeoutError)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Once the server answers again the connections are usable, and no stale reply of a timed-out call is read
        # as the answer to a new one.
        time.sleep(0.1)
        for _ in range(3):
            got = b.get_tickets(s.keys)
            assert got[1:] == s.encoded[1:] and got[0] in (None, s.encoded[0])
            assert read_whole(b, s) == [s.values]
        b.close()
        budgeted.close()

    @pytest.mark.timeout(30)
    def test_write_that_times_out_keeps_the_byte_accounting(self, dedicated_valkey, db: int, monkeypatch) -> None:
        # The server freezes after the budget was reserved, while the stripe's values are on their way: the write
        # fails at its one deadline (not one per step), and whether or not the server applies the values later,
        # the tier's byte count still equals the bytes of the stripes it lists (no drift, no orphaned values).
        url, pid = _db_url(dedicated_valkey.urls[0], db), dedicated_valkey.pids[0]
        timeout_s = 1.0
        s = make_stripe(1)
        b = ValkeyBackend(url, timeout_s=timeout_s, capacity_bytes=4 * s.nbytes)
        assert b.write_stripe(s.write) is True
        data_path = "_resp_run" if db == 0 else "_pipeline"  # what sends the values (after the reservation)
        send = getattr(b, data_path)

        def freeze_then_send(*args, **kwargs):
            os.kill(pid, signal.SIGSTOP)
            return send(*args, **kwargs)

        monkeypatch.setattr(b, data_path, freeze_then_send)
        late = make_stripe(2)
        start = time.monotonic()
        try:
            with pytest.raises(BackendTimeoutError, match=_url_pattern(url)):
                b.write_stripe(late.write)
            elapsed_s = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        monkeypatch.undo()
        assert elapsed_s < timeout_s + 0.5
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            time.sleep(0.2)  # let the server apply whatever reached it
            audit_valkey(admin)
            assert b.used_bytes() <= b.capacity_bytes
            # The budget is not leaked: the tier fills up to its capacity again.
            for i in range(4):
                assert b.write_stripe(make_stripe(10 + i).write) is True
            audit_valkey(admin)
            assert b.used_bytes() == 4 * s.nbytes
        finally:
            admin.close()
            b.close()

    @pytest.mark.timeout(20)
    def test_case_C21_trickling_server_raises_timeout_within_the_deadline(self, db: int) -> None:
        # One key answers after a very long delay. Each byte arrives within the socket timeout, so only a per-call
        # deadline catches it.
        timeout_s = 0.3
        server = _TricklingServer(interval_s=timeout_s / 2)
        try:
            b = ValkeyBackend(_db_url(server.url, db), timeout_s=timeout_s)
            calls = [
                ("get_tickets", lambda: b.get_tickets([b"rc2:t:slow"])),
                ("read_ranges", lambda: b.read_ranges([RangeRead("slow", 0, 0, 8, 8, memoryview(bytearray(8)))])),
                ("read_ranges sub-range",
                 lambda: b.read_ranges([RangeRead("slow", 0, 2, 4, 8, memoryview(bytearray(4)))])),
            ]
            try:
                for name, call in calls:
                    start = time.monotonic()
                    with pytest.raises(BackendTimeoutError, match=_url_pattern(server.url)):
                        call()
                    assert time.monotonic() - start < timeout_s + 1.0, name
            finally:
                b.close()
        finally:
            server.close()

    @pytest.mark.timeout(20)
    def test_closed_port_raises_backend_error_naming_the_url(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"valkey://127.0.0.1:{port}"  # nothing listens there any more

        start = time.monotonic()
        with pytest.raises(BackendError, match=url):
            ValkeyBackend(url, timeout_s=1.0)
        assert time.monotonic() - start < 2.0

    @pytest.mark.timeout(20)
    def test_case_C19_oversize_write_against_a_stale_limit_fails_cleanly(self, dedicated_valkey, db: int) -> None:
        # The limit was read at start-up and the server's was lowered later: the oversize write fails with a typed
        # error (not a hang), publishes no ticket, leaves the accounting straight, and the connections stay healthy.
        url = _db_url(dedicated_valkey.urls[0], db)
        s = make_stripe(1)
        b = ValkeyBackend(url, timeout_s=2.0, capacity_bytes=8 * SERVER_LIMIT_BYTES)
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            assert b.write_stripe(s.write) is True
            admin.config_set("proto-max-bulk-len", SERVER_LIMIT_BYTES)
            big = make_stripe(2, num_layers=2, num_chunks=1, blocks_per_chunk=1, num_planes=1,
                              row_bytes=2 * SERVER_LIMIT_BYTES)
            start = time.monotonic()
            with pytest.raises(BackendError):
                b.write_stripe(big.write)
            assert time.monotonic() - start < 2.5
            assert admin.exists(big.keys[0]) == 0
            audit_valkey(admin)
            for _ in range(3):
                assert b.get_tickets(s.keys + big.keys) == s.encoded + [None]
                assert read_whole(b, s) == [s.values]
            small = make_stripe(3)
            assert b.write_stripe(small.write) is True
            assert read_whole(b, small) == [small.values]
        finally:
            admin.close()
            b.close()

    @pytest.mark.timeout(20)
    def test_backends_on_two_shard_servers_are_independent(self, valkey_servers) -> None:
        b0, b1 = (ValkeyBackend(url, timeout_s=5.0) for url in valkey_servers.urls[:2])
        admins = [valkey.Valkey.from_url(url, socket_timeout=5.0) for url in valkey_servers.urls[:2]]
        try:
            s = make_stripe(1)
            assert b0.write_stripe(s.write) is True
            assert b1.get_tickets(s.keys) == [None] * len(s.keys)
            assert read_whole(b1, s) == [None]
            assert b0.get_tickets(s.keys) == s.encoded
        finally:
            b0.close()
            b1.close()
            for admin in admins:
                admin.flushdb()
                admin.close()
