"""The conformance suite's shared part: stripes as a writer builds them, and one :class:`Store` per kind of backend.

The stripe-store protocol (``range_connector.backends.base``) is checked against every backend by the
``TestStripeStoreContract`` classes of ``test_conformance_stripes.py``, ``test_conformance_tickets.py`` and
``test_conformance_leases.py``; each runs once per backend through the ``store`` fixture
(``tests/backends/conftest.py``: ``memory``: :class:`MemoryBackend`, the reference; ``latency``: the reference
behind the latency-injecting wrapper; ``file``; ``valkey``: :class:`ValkeyBackend` on a real server, flushed around
every test). A :class:`Store` wraps what is backend-specific: building backends (with a byte budget, or with a
lowered value limit), the server-side command counts (Valkey ``INFO commandstats``; none for memory), the leases the
tier still holds, and an audit of the tier's own byte accounting. ``test_valkey_failures.py`` covers deadlines and
failures that only a remote tier has.

The Valkey tier runs twice: ``valkey`` (database 0, no password) and ``valkey-auth-db1`` (a server that requires a
password, database 1: ``AUTH`` and ``SELECT`` once per connection); both take the bulk data path through our own RESP
connection (TLS and unix sockets too: ``test_valkey_security.py``). Cases (``/work/shared/cases/README.md``): C15, C16, C19,
C21, C27.

This module holds no tests. A new backend joins the suite with a :class:`Store` here and a parameter of the
``store`` fixture.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import pytest
import valkey

from range_connector.backends.base import Backend, RangeRead, StripeWrite, deployment_key_prefix
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.latency import LatencyBackend, LatencyControl, TierLatency
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.config.keys import DEFAULT_DEPLOYMENT
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket, ticket_key

#: the key prefix of the default deployment on Valkey
PREFIX = deployment_key_prefix(DEFAULT_DEPLOYMENT)

MiB = 1 << 20
SERVER_LIMIT_BYTES = 1 * MiB  # the smallest proto-max-bulk-len Valkey accepts
# Server-side commands that are not the call being measured: the measuring's own INFO, and the handshake of a fresh
# connection (it introduces itself and selects its database).
_MEASURING_COMMANDS = ("info", "client", "hello", "ping", "select", "auth")  # (auth: the measuring client logs in)


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
        return sum(self._admin.hlen(k) for k in self._admin.scan_iter(match=f"{PREFIX}l:*", count=1000))

    def audit(self, backend: Backend) -> None:
        audit_valkey(self._admin)
        if backend.capacity_bytes is not None:
            assert backend.used_bytes() <= backend.capacity_bytes

    def close(self) -> None:
        for b in self._backends:
            b.close()
        self._admin.flushdb()
        self._admin.close()


def audit_valkey(admin: valkey.Valkey, prefix: str = PREFIX) -> None:
    """The Valkey tier's bookkeeping of one deployment (``prefix``; see :meth:`Store.audit`)."""
    keys = [k.decode() for k in admin.scan_iter(match=f"{prefix}*", count=1000)]
    manifests = {k.removeprefix(f"{prefix}m:"): msgpack.unpackb(admin.get(k)) for k in keys
                 if k.startswith(f"{prefix}m:")}
    lru = {m.decode() for m in admin.zrange(f"{prefix}lru", 0, -1)}
    used = int(admin.get(f"{prefix}used") or 0)
    assert used == sum(m[0] for m in manifests.values()), (used, manifests)
    assert set(manifests) == lru
    for k in keys:
        if k.startswith(f"{prefix}s:"):
            sid, layer = k.removeprefix(f"{prefix}s:").split(":")
            assert sid in manifests and int(layer) < manifests[sid][1], f"orphaned layer value {k}"
        elif k.startswith(f"{prefix}t:"):
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


# ---------------------------------------------------------------------------------------------------- contract
class StripeStoreContract:
    """Base of the ``TestStripeStoreContract`` classes: what several topics of the contract share."""

    @staticmethod
    def _fill(b: Backend, n: int, seed: int = 100) -> list[Stripe]:
        stripes = [make_stripe(seed + i) for i in range(n)]
        for s in stripes:
            assert b.write_stripe(s.write) is True
        return stripes
