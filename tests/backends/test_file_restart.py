"""File tier (:class:`range_connector.backends.file.backend.FileBackend`) after a restart: a new instance over an
existing directory serves what was stored (stripes, tickets, deleted tickets, leases, the LRU order and the byte
count all come from the files), and what another namespace or deployment wrote there is never served.

The tier stores no identity of its own: a namespace (model, layout, salt, ...) enters every chunk hash, so another
namespace's lookups name other keys and miss, and its stripes age out by LRU; a deployment is a directory of its own
(``<directory>/<deployment>/shard-<s>``, made by the factory), which no other deployment opens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from range_connector.backends.base import Backend, StripeWrite
from range_connector.backends.factory import open_shard_backends
from range_connector.backends.file.backend import FileBackend
from range_connector.config import RangeConfig
from range_connector.kv.namespace import namespace_fingerprint, prefix_hash_chain
from range_connector.kv.tickets import ticket_key
from tests.backends.conformance import is_stored, make_stripe
from tests.backends.test_file_backend import _read, _stripe, _stripe_bytes_on_disk

CHUNK_TOKENS = 16
TOKENS = list(range(5000, 5000 + 4 * CHUNK_TOKENS))


def _keys(namespace_fields: dict) -> list[bytes]:
    """Shard 0's ticket keys of :data:`TOKENS`' four chunks under a namespace."""
    chain = prefix_hash_chain(namespace_fingerprint(namespace_fields), b"", TOKENS, CHUNK_TOKENS)
    return [ticket_key(h, 0) for h in chain]


@pytest.mark.timeout(60)
def test_a_new_backend_over_an_existing_directory_serves_what_was_stored(tmp_path: Path) -> None:
    root = tmp_path / "shard"
    one = 2 * 10_000
    ws = [_stripe(f"r{i}", 2, 10_000, num_chunks=3, seed=i) for i in range(4)]
    before = FileBackend(root, 4 * one)
    for w in ws:
        assert before.write_stripe(w)
    before.delete_tickets([b"r0:chunk0"])
    before.drop_stripes(["r1"])
    before.lease(["r2"], 60.0)  # a lease outlives the instance that took it
    assert _read(before, "r3", 0, 0, 1)[0] and _read(before, "r0", 0, 0, 1)[0]  # LRU: r2 (leased), r3, r0
    before.close()
    del before

    after = FileBackend(root, 4 * one)  # the ticket log replayed from the start, the rest read from the directory
    expected = {k: t for w in ws for k, t in w.tickets if not k.startswith(b"r1:")} | {b"r0:chunk0": None}
    assert after.get_tickets(list(expected)) == list(expected.values())
    assert after.get_tickets([k for k, _ in ws[1].tickets]) == [None] * 3
    assert after.used_bytes() == _stripe_bytes_on_disk(root) == 3 * one and after.num_leases() == 1
    assert after.write_stripe(_stripe("n0", 2, 10_000, seed=10))  # fits: nothing goes
    assert after.write_stripe(_stripe("n1", 2, 10_000, seed=11))  # r2 is the oldest but leased: r3 goes
    assert sorted(os.listdir(root / "stripes")) == ["n0", "n1", "r0", "r2"]
    assert after.get_tickets([b"r3:chunk1", b"r0:chunk1"]) == [None, ws[0].tickets[1][1]]
    for w in (ws[0], ws[2]):
        for layer in range(2):
            assert _read(after, w.stripe_id, layer, 0, 10_000) == (True, w.layer_values[layer])
    assert not _read(after, "r1", 0, 0, 1)[0] and not _read(after, "r3", 0, 0, 1)[0]
    after.close()


@pytest.mark.timeout(60)
def test_after_a_restart_another_namespace_finds_nothing_and_the_old_stripes_age_out(tmp_path: Path) -> None:
    root = tmp_path / "shard"
    old_keys = _keys({"model": "m", "revision": "a", "block_size": 16})
    new_keys = _keys({"model": "m", "revision": "b", "block_size": 16})  # another revision: other KV bytes
    assert not set(old_keys) & set(new_keys)
    old = StripeWrite("old", _stripe("old", 2, 10_000, seed=1).layer_values,
                      [(k, b"old ticket %d" % c) for c, k in enumerate(old_keys)])
    writer = FileBackend(root, 2 * 2 * 10_000)
    assert writer.write_stripe(old)
    writer.close()

    b = FileBackend(root, 2 * 2 * 10_000)  # restarted under the new namespace: its lookups name other keys
    assert b.get_tickets(new_keys) == [None] * 4
    for i in range(2):  # the new namespace's saves; the old stripe, unused since, is the one that makes room
        w = StripeWrite(f"new{i}", _stripe(f"new{i}", 2, 10_000, seed=2 + i).layer_values,
                        [(k, b"new ticket %d" % c) for c, k in enumerate(new_keys)])
        assert b.write_stripe(w)
    assert b.get_tickets(old_keys) == [None] * 4 and not _read(b, "old", 0, 0, 1)[0]
    assert b.get_tickets(new_keys) == [b"new ticket %d" % c for c in range(4)]
    assert sorted(os.listdir(root / "stripes")) == ["new0", "new1"]
    assert b.used_bytes() == _stripe_bytes_on_disk(root) == 2 * 2 * 10_000
    b.close()


@pytest.mark.timeout(60)
def test_after_a_restart_another_deployment_on_the_same_directory_reads_nothing(tmp_path: Path) -> None:
    def open_one(deployment: str) -> Backend:
        config = RangeConfig.from_extra_config({"deployment": deployment, "tiers": [
            {"type": "file", "directory": str(tmp_path)}]}).resolve(16)
        [backend] = open_shard_backends(config)
        return backend

    alpha = open_one("alpha")
    s = make_stripe(80)
    assert alpha.write_stripe(s.write)
    alpha.close()

    for deployment in ("beta", "default"):  # the same directory, the same prompt's ticket keys
        other = open_one(deployment)
        assert isinstance(other, FileBackend) and other.root == tmp_path / deployment / "shard-0"
        assert other.get_tickets(s.keys) == [None] * len(s.keys)
        assert not is_stored(other, s) and other.used_bytes() == 0
        other.clear()  # and its reset leaves alpha's entries alone
        other.close()
    again = open_one("alpha")
    assert again.get_tickets(s.keys) == s.encoded and is_stored(again, s)
    assert again.used_bytes() == s.nbytes
    again.close()
