"""Conformance, capacity and leases: least-recently-used eviction under a byte budget, leases that keep a stripe
(counted, expiring, never cut by a shorter one), and sustained eviction with promised stripes (C15, C16); for every
backend.

The backends and their :class:`~tests.backends.conformance.Store` are in ``tests/backends/conformance.py``; the
``store`` fixture that runs each test once per backend is in ``tests/backends/conftest.py``.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from tests.backends.conformance import (
    Store,
    Stripe,
    StripeStoreContract,
    is_stored,
    make_stripe,
    read_whole,
)


# ---------------------------------------------------------------------------------------------------- contract
class TestStripeStoreContract(StripeStoreContract):
    """The stripe-store contract (module docstring of ``range_connector.backends.base``), for every backend: leases."""

    # ------------------------------------------------------------------ capacity and leases

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
        leased_at = time.monotonic()
        b.lease([a.sid, bb.sid], ttl_s=1.0)
        c = make_stripe(7)
        refused = b.write_stripe(c.write) is False
        if time.monotonic() - leased_at < 1.0:  # (asked while the lease was surely live: a stall cannot fail this)
            assert refused

        time.sleep(1.15)  # (past the lease's expiry, however late the sleep starts)

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
        new = make_stripe(2, num_chunks=3, keys=[old.keys[1], old.keys[2], b"t:%064x:s0:r0" % 7])
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
