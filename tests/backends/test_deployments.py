"""Deployments on shared tiers: two deployments on one Valkey server (or one file-tier directory) keep their own
tickets, stripes, LRU and byte budget, a reset (clear) of one leaves the other intact, and a save in flight at the
reset stores nothing (issue 16, items 2 and 5 of what was found). Real Valkey servers, real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import valkey

from range_connector.backends.base import Backend, deployment_key_prefix
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.config import RangeConfig
from range_connector.backends.factory import open_shard_backends
from tests.backends.conformance import audit_valkey, is_stored, make_stripe


@pytest.fixture
def server(dedicated_valkey) -> str:
    return dedicated_valkey.urls[0]


def _keys(url: str, deployment: str) -> set[bytes]:
    admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        return set(admin.scan_iter(match=f"{deployment_key_prefix(deployment)}*", count=1000))
    finally:
        admin.close()


def _used(url: str, deployment: str) -> int:
    admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
    try:
        return int(admin.get(f"{deployment_key_prefix(deployment)}used") or 0)
    finally:
        admin.close()


@pytest.mark.timeout(60)
def test_two_deployments_on_one_server_read_only_their_own(server: str) -> None:
    a = ValkeyBackend(server, deployment="alpha")
    b = ValkeyBackend(server, deployment="beta")
    try:
        sa = make_stripe(1)
        sb = make_stripe(2, keys=sa.keys)  # the same prompt's ticket keys, other bytes
        assert a.write_stripe(sa.write) and b.write_stripe(sb.write)
        assert a.get_tickets(sa.keys) == sa.encoded
        assert b.get_tickets(sa.keys) == sb.encoded
        assert is_stored(a, sa) and not is_stored(a, sb)  # a stripe of the other deployment is a miss
        assert is_stored(b, sb) and not is_stored(b, sa)
        plain = ValkeyBackend(server)  # the default deployment sees neither
        assert plain.get_tickets(sa.keys) == [None] * len(sa.keys)
        plain.close()
        admin = valkey.Valkey.from_url(server)
        audit_valkey(admin, deployment_key_prefix("alpha"))
        audit_valkey(admin, deployment_key_prefix("beta"))
        admin.close()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_budgets_are_per_deployment(server: str) -> None:
    one = make_stripe(3).nbytes
    a = ValkeyBackend(server, deployment="alpha", capacity_bytes=2 * one)
    b = ValkeyBackend(server, deployment="beta", capacity_bytes=2 * one)
    try:
        kept = [make_stripe(10 + i) for i in range(2)]
        for s in kept:
            assert b.write_stripe(s.write)
        filled = [make_stripe(20 + i) for i in range(5)]  # alpha fills its budget over and over
        for s in filled:
            assert a.write_stripe(s.write)
        assert a.used_bytes() == 2 * one and b.used_bytes() == 2 * one
        assert all(is_stored(b, s) for s in kept)  # beta's entries were not evicted for alpha's
        assert [is_stored(a, s) for s in filled] == [False, False, False, True, True]
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_reset_of_one_deployment_leaves_the_other(server: str) -> None:
    a = ValkeyBackend(server, deployment="alpha", capacity_bytes=1 << 20)
    b = ValkeyBackend(server, deployment="beta")
    try:
        sa, sb = [make_stripe(30 + i) for i in range(3)], [make_stripe(40 + i) for i in range(3)]
        for s in sa:
            assert a.write_stripe(s.write)
        for s in sb:
            assert b.write_stripe(s.write)
        a.lease([sa[0].sid], 60.0)
        before_b = _keys(server, "beta")
        a.clear()
        assert _keys(server, "alpha") == {f"{deployment_key_prefix('alpha')}epoch".encode()}  # only the fence
        assert _used(server, "alpha") == 0 and a.used_bytes() == 0
        assert _keys(server, "beta") == before_b and b.used_bytes() == sum(s.nbytes for s in sb)
        assert all(is_stored(b, s) and b.get_tickets(s.keys) == s.encoded for s in sb)
        assert not any(is_stored(a, s) for s in sa)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_save_in_flight_at_a_reset_stores_nothing_on_valkey(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reset comes after the reservation and before the values and the commit reach the server (the seam:
    the backend's round trip that carries them). (Without a budget the reservation rides in that same round trip,
    so no reset can come between them from outside.)"""
    writer = ValkeyBackend(server, deployment="alpha", capacity_bytes=1 << 20)
    resetter = ValkeyBackend(server, deployment="alpha")
    try:
        s = make_stripe(50)
        real, name = writer._resp_run, "_resp_run"
        calls = []

        def reset_first(*args, **kwargs):
            if not calls:
                calls.append(1)
                resetter.clear()
            return real(*args, **kwargs)

        monkeypatch.setattr(writer, name, reset_first)
        assert writer.write_stripe(s.write) is False
        assert calls
        assert resetter.get_tickets(s.keys) == [None] * len(s.keys)
        assert not is_stored(resetter, s)
        assert _keys(server, "alpha") == {f"{deployment_key_prefix('alpha')}epoch".encode()}
        monkeypatch.undo()
        again = make_stripe(51)  # the next save, after the reset, is stored
        assert writer.write_stripe(again.write) is True and is_stored(resetter, again)
    finally:
        writer.close()
        resetter.close()


@pytest.mark.timeout(60)
def test_a_save_in_flight_at_a_reset_stores_nothing_on_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = FileBackend(tmp_path / "alpha" / "shard-0", 1 << 20)
    resetter = FileBackend(tmp_path / "alpha" / "shard-0")
    try:
        s = make_stripe(60)
        real = writer._files.write

        def reset_then_write(*args, **kwargs):  # between the reservation and the publication
            resetter.clear()
            return real(*args, **kwargs)

        monkeypatch.setattr(writer._files, "write", reset_then_write)
        assert writer.write_stripe(s.write) is False
        assert resetter.get_tickets(s.keys) == [None] * len(s.keys)
        assert writer.used_bytes() == 0 and not is_stored(resetter, s)
        monkeypatch.undo()
        again = make_stripe(61)
        assert writer.write_stripe(again.write) is True and resetter.get_tickets(again.keys) == again.encoded
    finally:
        writer.close()
        resetter.close()


@pytest.mark.timeout(60)
def test_file_tier_deployments_get_directories_of_their_own(tmp_path: Path) -> None:
    def open_one(deployment: str) -> Backend:
        config = RangeConfig.from_extra_config({"deployment": deployment, "tiers": [
            {"type": "file", "directory": str(tmp_path)}]}).resolve(16)
        return open_shard_backends(config)[0]

    a, b = open_one("alpha"), open_one("beta")
    try:
        assert isinstance(a, FileBackend) and a.root == tmp_path / "alpha" / "shard-0"
        sa = make_stripe(70)
        sb = make_stripe(71, keys=sa.keys)
        assert a.write_stripe(sa.write) and b.write_stripe(sb.write)
        a.clear()
        assert a.get_tickets(sa.keys) == [None] * len(sa.keys)
        assert b.get_tickets(sa.keys) == sb.encoded and is_stored(b, sb)
    finally:
        a.close()
        b.close()
