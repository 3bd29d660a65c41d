"""Conformance, clear: :meth:`Backend.clear` removes every entry of the backend's deployment (stripes, tickets,
leases, the byte count), leaves the tier usable, and a write that began before it stores nothing; for every backend.

The backends and their :class:`~tests.backends.conformance.Store` are in ``tests/backends/conformance.py``; the
``store`` fixture that runs each test once per backend is in ``tests/backends/conftest.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.backends.conformance import Store, StripeStoreContract, is_stored, make_stripe


class TestStripeStoreContract(StripeStoreContract):
    """The stripe-store contract (module docstring of ``range_connector.backends.base``), for every backend: clear."""

    @pytest.mark.timeout(30)
    @pytest.mark.parametrize("capacity_bytes", [None, 1 << 20])
    def test_clear_removes_stripes_tickets_leases_and_bytes(self, store: Store, capacity_bytes: int | None) -> None:
        b = store.make(capacity_bytes)
        stripes = self._fill(b, 3)
        b.lease([stripes[0].sid], ttl_s=60.0)  # leased entries go too
        assert b.used_bytes() == sum(s.nbytes for s in stripes)
        b.clear()
        for s in stripes:
            assert b.get_tickets(s.keys) == [None] * len(s.keys)
            assert not is_stored(b, s)
        assert b.used_bytes() == 0
        assert store.leases_held(b) == 0
        store.audit(b)
        again = make_stripe(7)  # the tier stays usable
        assert b.write_stripe(again.write) is True
        assert is_stored(b, again) and b.get_tickets(again.keys) == again.encoded
        store.audit(b)

    @pytest.mark.timeout(30)
    def test_clear_of_an_empty_tier_and_twice(self, store: Store) -> None:
        b = store.make()
        b.clear()
        b.clear()
        assert b.used_bytes() == 0
        s = make_stripe(8)
        assert b.write_stripe(s.write) is True and is_stored(b, s)

    @pytest.mark.timeout(30)
    def test_clear_is_seen_by_another_instance_of_the_same_deployment(self, store: Store) -> None:
        writer = store.make()
        if writer.is_shared:
            reader = store.make()
        else:
            reader = writer  # (an in-process tier has no second view of itself)
        s = self._fill(writer, 1)[0]
        assert reader.get_tickets(s.keys) == s.encoded
        writer.clear()
        assert reader.get_tickets(s.keys) == [None] * len(s.keys)
        assert not is_stored(reader, s)

    @pytest.mark.timeout(30)
    @pytest.mark.parametrize("capacity_bytes", [None, 1 << 20])
    def test_a_write_gathered_before_a_clear_by_another_instance_stores_nothing(self, store: Store,
                                                                                capacity_bytes: int | None) -> None:
        # A shared tier's writer stamps each save with the epoch it saw when the save was gathered; another
        # instance's clear (the scheduler's reset) comes before the write: the tier stores nothing, and the writer's
        # hint catches up so that its next save lands.
        writer = store.make(capacity_bytes)
        if not writer.is_shared:
            pytest.skip("in-process tiers are cleared by their own worker; they have no reset epoch")
        other = store.make(capacity_bytes)
        gathered = writer.epoch_hint
        assert gathered is not None
        other.clear()
        s = make_stripe(9)
        assert writer.write_stripe(dataclasses.replace(s.write, epoch=gathered)) is False
        assert not is_stored(other, s) and other.get_tickets(s.keys) == [None] * len(s.keys)
        assert other.used_bytes() == 0
        store.audit(other)
        assert writer.epoch_hint == gathered + 1
        t = make_stripe(10)
        assert writer.write_stripe(dataclasses.replace(t.write, epoch=writer.epoch_hint)) is True
        assert is_stored(other, t)
