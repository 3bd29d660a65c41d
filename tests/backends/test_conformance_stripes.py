"""Conformance, stripes: written and read back byte-exact (byte ranges, buffers of any format, misses, scatter reads,
reads outside a value, lent views), value limits (C19), and concurrent writers and readers; for every backend.

The backends and their :class:`~tests.backends.conformance.Store` are in ``tests/backends/conformance.py``; the
``store`` fixture that runs each test once per backend is in ``tests/backends/conftest.py``.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import xxhash

from range_connector.backends.base import RangeRead, ScatterDest, StripeWrite
from range_connector.errors import BackendError
from range_connector.worker.direct_receive import WriteGate
from tests.backends.conformance import (
    SERVER_LIMIT_BYTES,
    Store,
    Stripe,
    StripeStoreContract,
    _delta,
    is_stored,
    make_stripe,
    read_whole,
)


# ---------------------------------------------------------------------------------------------------- contract
class TestStripeStoreContract(StripeStoreContract):
    """The stripe-store contract (module docstring of ``range_connector.backends.base``), for every backend: stripes."""

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
