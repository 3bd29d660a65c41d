"""Conformance, tickets and costs: ticket lookups in one round trip, the cost of every call following bytes and not
chunks (docs/architecture.md, principle 1), deleted tickets and dropped stripes (C27), and the byte counters; for every
backend.

The backends and their :class:`~tests.backends.conformance.Store` are in ``tests/backends/conformance.py``; the
``store`` fixture that runs each test once per backend is in ``tests/backends/conftest.py``.
"""

from __future__ import annotations

import random
import uuid

import pytest

from range_connector.backends.base import RangeRead
from range_connector.kv.tickets import Ticket
from tests.backends.conformance import (
    MiB,
    Store,
    StripeStoreContract,
    _delta,
    is_stored,
    make_stripe,
    read_whole,
    server_delta,
)


# ---------------------------------------------------------------------------------------------------- contract
class TestStripeStoreContract(StripeStoreContract):
    """The stripe-store contract (module docstring of ``range_connector.backends.base``), for every backend: tickets."""

    # ------------------------------------------------------------------ tickets
    @pytest.mark.timeout(30)
    @pytest.mark.parametrize("num_keys", [1, 10, 1000])
    def test_get_tickets_is_one_round_trip_and_one_command(self, store: Store, num_keys: int) -> None:
        b = store.make()
        s = make_stripe(3, num_chunks=num_keys, blocks_per_chunk=1, row_bytes=8)
        assert b.write_stripe(s.write) is True
        missing = [b"t:%064x:s0:r0" % i for i in range(num_keys // 2)]
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
        assert b.get_tickets(missing or [b"t:none"]) == [None] * max(1, len(missing))
        assert b.get_tickets([]) == []
        assert all(Ticket.decode(raw, num_layers=2, layer_block_bytes=16, num_blocks=1) == t
                   for raw, t in zip(b.get_tickets(s.keys[:5]), s.tickets))

    # ----------------------------------------------------------- cost follows bytes (docs/architecture.md, principle 1)
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
            # the layer values, the manifest and the write guard (the reset epoch the write began in)
            assert write["mset"] == 1 and num_layers <= write["set"] <= num_layers + 2
            assert lookup == {"mget": 1}
            assert costs[4]["read_whole"][1].get("get") == num_layers
            assert "getrange" not in costs[4]["read_whole"][1]  # whole values are read with GET
            assert costs[4]["read_partial"][1].get("getrange") == num_layers * num_planes

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
        b.delete_tickets([s.keys[1], s.keys[2], b"t:never"])
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
        assert set(snap) == {"round_trips", "commands", "bytes_written", "bytes_read", "allocations", "copy_launches",
                             "saves_skipped_no_space"}
