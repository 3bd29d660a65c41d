"""LMCache objects as Range stripes: one batched call per shard per task, whatever the number of objects.

An object is an opaque byte string named by a 16-byte :data:`ObjectId` (the BLAKE3 of LMCache's key fields:
:func:`object_id`); it lives on shard ``int(id[:8]) % num_shards``. A store task becomes, per shard, one stripe
whose one layer value is the shard's objects end to end (several stripes only past the tier's value limit,
``Backend.max_value_bytes``), and one ticket per object (:meth:`~range_connector.kv.tickets.Ticket.decode_object`:
byte offset, length, xxh3-64 of the bytes). A lookup is one ticket read per shard (``MGET`` on Valkey) and one lease
per shard on the stripes it found; a load is one ranged read per shard (over two connections at once from
:data:`READ_SPLIT_MIN_BYTES` in several reads) straight into the caller's buffers, then
every object's checksum is verified; on a tier that scatters (Valkey, files, DRAM), objects that lie end to end in
one stripe are one read into their buffers (a whole stripe is one ``GET`` on Valkey). So the round trips and, for
objects stored together, the commands follow shards and stripes, never objects (docs/architecture.md, principle 1).

Errors are per object and never raised: a missing, malformed, wrongly sized, unreadable or corrupt object reads as
``False``; a corrupt object's ticket is deleted so it is not found again. Capacity is Range's: each backend's byte
budget, least-recently-used unleased stripes evicted with their tickets.

Thread-safe: the backends are (one connection pool per Valkey shard), and this class keeps no mutable state but
its executor.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NewType, TypeVar

import blake3
import msgpack
import xxhash

from range_connector.backends.base import Backend, RangeRead, ScatterDest, StripeWrite
from range_connector.errors import BackendError
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import Ticket, ticket_key

logger = logging.getLogger(__name__)

#: connections one shard's load reads over at once (when it is several reads of at least READ_SPLIT_MIN_BYTES)
READ_STREAMS = 2
READ_SPLIT_MIN_BYTES = 64 << 20

#: 16 bytes naming one LMCache object (:func:`object_id`).
ObjectId = NewType("ObjectId", bytes)
T = TypeVar("T")


def object_id(model_name: str, kv_rank: int, object_group_id: int, chunk_hash: bytes, cache_salt: str) -> ObjectId:
    """The id of LMCache's ``ObjectKey`` with these fields: BLAKE3 (16 bytes) of their msgpack encoding, so two
    keys differing in any field (the salt included) never share an id."""
    fields = msgpack.packb(["lmcache-object-1", model_name, kv_rank, object_group_id, chunk_hash, cache_salt])
    return ObjectId(blake3.blake3(fields).digest(16))


@dataclass(frozen=True, slots=True)
class ObjectLease:
    """A lease one lookup took on one shard: ``stripe_ids`` are protected from eviction until released by
    ``token`` (or until the lease's ttl passes)."""

    shard_idx: int
    token: str
    stripe_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What a store task stored.

    Attributes:
        stored: ``[num_objects]`` whether each object is now stored.
        bytes_stored: bytes of the objects stored.
    """

    stored: list[bool]
    bytes_stored: int


class ObjectStore:
    """LMCache objects on ``[num_shards]`` Range backends (one per shard, in shard order).

    Args:
        backends: ``[num_shards]`` backends; the store owns them (:meth:`close` closes them).
        lease_ttl_s: lifetime of a lookup's lease, seconds.
    """

    def __init__(self, backends: Sequence[Backend], *, lease_ttl_s: float) -> None:
        if not backends:
            raise ValueError("an object store needs at least one backend")
        self.backends = list(backends)
        self.lease_ttl_s = lease_ttl_s
        self._shard_pool = ThreadPoolExecutor(len(self.backends), thread_name_prefix="range-lmcache-shard")
        self._read_pool = ThreadPoolExecutor(len(self.backends) * max(1, READ_STREAMS - 1),
                                             thread_name_prefix="range-lmcache-read")

    @property
    def num_shards(self) -> int:
        """Shards (backends)."""
        return len(self.backends)

    def shard_of(self, oid: ObjectId) -> int:
        """The shard that holds object ``oid``."""
        return int.from_bytes(oid[:8], "little") % self.num_shards

    def key_of(self, oid: ObjectId) -> bytes:
        """The ticket key of object ``oid`` on its shard."""
        return ticket_key(ChunkHash(oid), self.shard_of(oid))

    # ------------------------------------------------------------------------------------------------------ store
    def store(self, oids: Sequence[ObjectId], buffers: Sequence[memoryview]) -> StoreResult:
        """Store objects: one stripe write per shard (more only past the tier's value limit).

        Args:
            oids: ``[num_objects]`` ids.
            buffers: ``[num_objects]`` flat byte views, ``len`` bytes each (copied before this returns).

        Returns:
            Which objects are stored: an object is not when its shard's write failed or was skipped for lack of
            room (everything evictable leased, or the stripe larger than the budget). Never raises for a tier.
        """
        by_shard = self._group(oids)
        results = self._per_shard(by_shard, lambda s, idxs: self._store_shard(s, [oids[i] for i in idxs],
                                                                               [buffers[i] for i in idxs]))
        stored = [False] * len(oids)
        for s, idxs in by_shard.items():
            for i, ok in zip(idxs, results.get(s) or [False] * len(idxs)):
                stored[i] = ok
        return StoreResult(stored, sum(buffers[i].nbytes for i, ok in enumerate(stored) if ok))

    def _store_shard(self, shard_idx: int, oids: list[ObjectId], buffers: list[memoryview]) -> list[bool]:
        backend = self.backends[shard_idx]
        stored: list[bool] = []
        for group in _value_groups([b.nbytes for b in buffers], backend.max_value_bytes):
            stripe_id = uuid.uuid4().hex
            value = bytearray(sum(buffers[i].nbytes for i in group))
            tickets = []
            pos = 0
            for i in group:
                n = buffers[i].nbytes
                value[pos:pos + n] = buffers[i]
                ticket = Ticket(stripe_id, pos, n, len(value), 1, 1, 1, (xxhash.xxh3_64_intdigest(buffers[i]),))
                tickets.append((self.key_of(oids[i]), ticket.encode()))
                pos += n
            try:
                ok = backend.write_stripe(StripeWrite(stripe_id, [value], tickets, epoch=backend.epoch_hint))
            except (BackendError, ValueError) as exc:
                logger.warning("%s: store of %d objects (%d bytes) failed: %s", backend.name, len(group),
                               len(value), exc)
                ok = False
            stored.extend([ok] * len(group))
        return stored

    # ----------------------------------------------------------------------------------------------------- lookup
    def lookup(self, oids: Sequence[ObjectId], *, lease: bool) -> tuple[list[Ticket | None], list[ObjectLease]]:
        """Find objects, one ticket read per shard, and (``lease``) lease the stripes found, one lease per shard.

        Returns:
            ``[num_objects]`` tickets (``None``: missing, malformed, or on a shard that failed to answer or to
            lease), and the leases taken (release them with :meth:`release`).
        """
        by_shard = self._group(oids)
        found = self._per_shard(by_shard, lambda s, idxs: self._lookup_shard(s, [oids[i] for i in idxs], lease))
        tickets: list[Ticket | None] = [None] * len(oids)
        leases = []
        for s, idxs in by_shard.items():
            shard_tickets, shard_lease = found.get(s) or ([None] * len(idxs), None)
            for i, t in zip(idxs, shard_tickets):
                tickets[i] = t
            if shard_lease is not None:
                leases.append(shard_lease)
        return tickets, leases

    def _lookup_shard(self, shard_idx: int, oids: list[ObjectId],
                      lease: bool) -> tuple[list[Ticket | None], ObjectLease | None]:
        backend = self.backends[shard_idx]
        try:
            raw = backend.get_tickets([self.key_of(o) for o in oids])
        except BackendError as exc:
            logger.warning("%s: lookup of %d objects failed: %s", backend.name, len(oids), exc)
            return [None] * len(oids), None
        tickets = [Ticket.decode_object(r, max_layer_bytes=backend.max_value_bytes) for r in raw]
        stripe_ids = tuple(dict.fromkeys(t.stripe_id for t in tickets if t is not None))
        if not lease or not stripe_ids:
            return tickets, None
        try:
            token = backend.lease(stripe_ids, self.lease_ttl_s)
        except BackendError as exc:  # (an object that cannot be protected is not promised)
            logger.warning("%s: lease of %d stripes failed: %s", backend.name, len(stripe_ids), exc)
            return [None] * len(oids), None
        return tickets, ObjectLease(shard_idx, token, stripe_ids)

    def release(self, leases: Sequence[ObjectLease]) -> bool:
        """Release leases (one call per lease; an expired one is harmless).

        Returns:
            Whether every release reached its shard (a lease that did not expires after ``lease_ttl_s``).
        """
        ok = True
        for lease in leases:
            try:
                self.backends[lease.shard_idx].release(lease.stripe_ids, lease.token)
            except BackendError as exc:
                logger.warning("%s: release of %d stripes failed: %s", self.backends[lease.shard_idx].name,
                               len(lease.stripe_ids), exc)
                ok = False
        return ok

    # ------------------------------------------------------------------------------------------------------- load
    def load(self, oids: Sequence[ObjectId], dests: Sequence[memoryview],
             tickets: Sequence[Ticket | None] | None = None) -> list[bool]:
        """Read objects into the caller's buffers: one ranged read per shard (plus one ticket read per shard for
        the objects whose ticket is not given), then the checksum of every object.

        Args:
            oids: ``[num_objects]`` ids.
            dests: ``[num_objects]`` flat writable byte views, exactly the object's size each (a read-only one is a
                miss).
            tickets: ``[num_objects]`` tickets from :meth:`lookup` (``None`` entries, or no list: read them now).

        Returns:
            ``[num_objects]``: ``True`` where ``dests[i]`` holds exactly the stored bytes; ``False`` where the object
            is missing, of another size, gone, unreadable or corrupt (``dests[i]`` then holds undefined bytes). A
            corrupt object's ticket is deleted. Never raises for a tier.
        """
        given = list(tickets) if tickets is not None else [None] * len(oids)
        by_shard = self._group(oids)
        results = self._per_shard(by_shard, lambda s, idxs: self._load_shard(
            s, [oids[i] for i in idxs], [dests[i] for i in idxs], [given[i] for i in idxs]))
        loaded = [False] * len(oids)
        for s, idxs in by_shard.items():
            for i, ok in zip(idxs, results.get(s) or [False] * len(idxs)):
                loaded[i] = ok
        return loaded

    def _load_shard(self, shard_idx: int, oids: list[ObjectId], dests: list[memoryview],
                    tickets: list[Ticket | None]) -> list[bool]:
        backend = self.backends[shard_idx]
        unknown = [j for j, t in enumerate(tickets) if t is None]
        if unknown:
            try:
                raw = backend.get_tickets([self.key_of(oids[j]) for j in unknown])
            except BackendError as exc:
                logger.warning("%s: ticket read of %d objects failed: %s", backend.name, len(unknown), exc)
                raw = [None] * len(unknown)
            for j, r in zip(unknown, raw):
                tickets[j] = Ticket.decode_object(r, max_layer_bytes=backend.max_value_bytes)
        wanted = [j for j, t in enumerate(tickets)
                  if t is not None and t.num_blocks == dests[j].nbytes and not dests[j].readonly]
        runs = _contiguous_runs(wanted, tickets) if backend.supports_scatter else [[j] for j in wanted]
        digests = [_RunDigests([dests[j].nbytes for j in run]) if len(run) > 1 else None for run in runs]
        reads = [_run_read(run, tickets, dests, d) for run, d in zip(runs, digests)]
        loaded = [False] * len(oids)
        if not reads:
            return loaded
        present = self._read(backend, reads)
        corrupt = []
        for j, ok, landed in ((j, ok, d and d.digest_of(k)) for run, ok, d in zip(runs, present, digests)
                              for k, j in enumerate(run)):
            t = tickets[j]
            checksum = landed if landed is not None else (xxhash.xxh3_64_intdigest(dests[j]) if ok else None)
            if ok and t is not None and checksum == t.checksums[0]:
                loaded[j] = True
            elif ok:
                corrupt.append(self.key_of(oids[j]))
        if corrupt:
            logger.warning("%s: %d objects failed their checksum; their tickets are deleted", backend.name,
                           len(corrupt))
            try:
                backend.delete_tickets(corrupt)
            except BackendError as exc:
                logger.warning("%s: could not delete %d corrupt tickets: %s", backend.name, len(corrupt), exc)
        return loaded

    def _read(self, backend: Backend, reads: list[RangeRead]) -> list[bool]:
        """``backend.read_ranges(reads)``, split over :data:`READ_STREAMS` connections at once when the reads are
        several and hold at least :data:`READ_SPLIT_MIN_BYTES` (bytes land in two sockets at once: one loopback
        connection alone leaves the server and the receiver waiting for each other). A part that fails is
        ``False`` for its reads, the other parts count (never raises for a tier)."""
        groups = _split_reads(reads, READ_STREAMS if sum(r.length for r in reads) >= READ_SPLIT_MIN_BYTES else 1)
        futures = [self._read_pool.submit(self._read_group, backend, reads, g) for g in groups[1:]]
        parts = [self._read_group(backend, reads, groups[0]), *(f.result() for f in futures)]
        present = [False] * len(reads)
        for group, part in zip(groups, parts):
            for i, ok in zip(group, part):
                present[i] = ok
        return present

    @staticmethod
    def _read_group(backend: Backend, reads: list[RangeRead], group: list[int]) -> list[bool]:
        try:
            return backend.read_ranges([reads[i] for i in group])
        except (BackendError, ValueError) as exc:  # (ValueError: a ticket that lies about its stripe)
            logger.warning("%s: read of %d bytes failed: %s", backend.name, sum(reads[i].length for i in group), exc)
            return [False] * len(group)

    # ----------------------------------------------------------------------------------------------------- admin
    def delete(self, oids: Sequence[ObjectId]) -> None:
        """Forget objects (one ticket delete per shard; their stripes age out by LRU). Never raises for a tier."""
        by_shard = self._group(oids)

        def run(s: int, idxs: list[int]) -> None:
            try:
                self.backends[s].delete_tickets([self.key_of(oids[i]) for i in idxs])
            except BackendError as exc:
                logger.warning("%s: delete of %d objects failed: %s", self.backends[s].name, len(idxs), exc)

        self._per_shard(by_shard, run)

    def used_bytes(self) -> int:
        """Bytes of stripes stored on all shards, as Range accounts them (one call per shard).

        Raises:
            BackendError: a shard does not answer.
        """
        return sum(b.used_bytes() for b in _distinct(self.backends))

    def capacity_bytes(self) -> int:
        """Range's byte budget over all shards (0: at least one shard has none)."""
        caps = [b.capacity_bytes for b in _distinct(self.backends)]
        return 0 if any(not c for c in caps) else sum(c for c in caps if c)

    def close(self) -> None:
        """Stop the shard threads and close the backends (stored bytes stay where the tier keeps them)."""
        self._shard_pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        for b in _distinct(self.backends):
            b.close()

    # --------------------------------------------------------------------------------------------------- helpers
    def _group(self, oids: Sequence[ObjectId]) -> dict[int, list[int]]:
        """``{shard_idx: [indices into oids]}`` (one shard: no per-object work)."""
        if self.num_shards == 1:
            return {0: list(range(len(oids)))} if oids else {}
        by_shard: dict[int, list[int]] = {}
        n = self.num_shards
        for i, oid in enumerate(oids):
            by_shard.setdefault(int.from_bytes(oid[:8], "little") % n, []).append(i)
        return by_shard

    def _per_shard(self, by_shard: dict[int, list[int]], fn: Callable[[int, list[int]], T]) -> dict[int, T | None]:
        """Run ``fn(shard_idx, indices)`` for every shard at once; a shard whose call raised maps to ``None``."""
        if len(by_shard) == 1:
            [(s, idxs)] = by_shard.items()
            return {s: self._guarded(fn, s, idxs)}
        futures = {s: self._shard_pool.submit(self._guarded, fn, s, idxs) for s, idxs in by_shard.items()}
        return {s: f.result() for s, f in futures.items()}

    def _guarded(self, fn: Callable[[int, list[int]], T], s: int, idxs: list[int]) -> T | None:
        try:
            return fn(s, idxs)
        except Exception:  # (a bug, not a tier: logged with its traceback, the shard's objects fail)
            logger.exception("%s: unexpected error in an object task", self.backends[s].name)
            return None


def _contiguous_runs(wanted: Sequence[int], tickets: Sequence[Ticket | None]) -> list[list[int]]:
    """Group the objects ``wanted`` (indices into ``tickets``, none ``None``) into runs that lie end to end in one
    stripe value, each run in offset order; an object wanted twice starts a run of its own.

    One pass in the given order when that order already has every stripe's objects together and ascending (what a
    load of objects stored by one task in the same order asks); otherwise the objects are sorted by stripe and
    offset first. Either way the work per object is a few attribute reads."""
    runs = _runs_in_order(wanted, tickets)
    if runs is None:
        runs = _runs_in_order(sorted(wanted, key=lambda j: (tickets[j].stripe_id,  # type: ignore[union-attr]
                                                            tickets[j].block_offset)), tickets, strict=False)
    assert runs is not None
    return runs


def _runs_in_order(order: Sequence[int], tickets: Sequence[Ticket | None], *,
                   strict: bool = True) -> list[list[int]] | None:
    """The runs of :func:`_contiguous_runs` taken in ``order``; with ``strict``, ``None`` as soon as a stripe's run
    breaks and the stripe turns up again later in ``order`` or goes backwards (sorting would find longer runs)."""
    runs: list[list[int]] = []
    run: list[int] = []
    done: set[str] = set()
    stripe, end, value_bytes = None, -1, -1
    for j in order:
        t = tickets[j]
        assert t is not None
        if t.stripe_id == stripe and t.stripe_blocks == value_bytes and t.block_offset == end:
            run.append(j)
            end += t.num_blocks
            continue
        if strict and (t.stripe_id in done or (t.stripe_id == stripe and t.block_offset < end)):
            return None
        if run:
            runs.append(run)
            done.add(stripe)  # type: ignore[arg-type]
        run = [j]
        stripe, end, value_bytes = t.stripe_id, t.block_offset + t.num_blocks, t.stripe_blocks
    if run:
        runs.append(run)
    return runs


class _RunDigests:
    """The xxh3-64 of each object of a run, updated as the tier lands the run's bytes (``ScatterDest.digest``: in
    order, while they are still in cache), so that verifying them needs no second pass over the bytes. An object whose
    bytes were not all seen this way has no digest here (:meth:`digest_of` is ``None``: the caller hashes it)."""

    def __init__(self, sizes_bytes: Sequence[int]) -> None:
        self._states = [xxhash.xxh3_64() for _ in sizes_bytes]
        self._left = list(sizes_bytes)
        self._i = 0
        self._skip_empty()

    def update(self, data: memoryview | bytes) -> None:
        """Add the next ``len(data)`` bytes of the run (a flat byte view, as the tiers pass: one call per piece
        segment, so the common call stays within one object and costs one hash update)."""
        view = data if isinstance(data, memoryview) and data.ndim == 1 and data.format == "B" else (
            memoryview(data).cast("B"))
        i, n = self._i, view.nbytes
        if i < len(self._left) and n <= self._left[i]:  # (within the current object: the common case)
            self._states[i].update(view)
            self._left[i] -= n
            if not self._left[i]:
                self._skip_empty()
            return
        while view.nbytes and self._i < len(self._states):
            n = min(view.nbytes, self._left[self._i])
            self._states[self._i].update(view[:n])
            self._left[self._i] -= n
            view = view[n:]
            self._skip_empty()

    def digest_of(self, k: int) -> int | None:
        """The digest of the run's ``k``-th object, or ``None`` if not all of its bytes were seen."""
        return self._states[k].intdigest() if self._left[k] == 0 else None

    def _skip_empty(self) -> None:
        while self._i < len(self._left) and self._left[self._i] == 0:
            self._i += 1


def _run_read(run: Sequence[int], tickets: Sequence[Ticket | None], dests: Sequence[memoryview],
              digests: _RunDigests | None = None) -> RangeRead:
    """One read of a run of objects: into the one object's buffer, or scattered over the run's buffers in order
    (a whole stripe value is then one ``GET`` on Valkey, whatever the number of objects in it), updating
    ``digests`` as the bytes land."""
    first = tickets[run[0]]
    assert first is not None
    if len(run) == 1:
        return RangeRead(first.stripe_id, 0, first.block_offset, first.num_blocks, first.stripe_blocks, dests[run[0]])
    pieces = tuple(dests[j] for j in run)
    return RangeRead(first.stripe_id, 0, first.block_offset, sum(p.nbytes for p in pieces), first.stripe_blocks,
                     ScatterDest(pieces, contextlib.nullcontext(), digests))


def _split_reads(reads: Sequence[RangeRead], num_groups: int) -> list[list[int]]:
    """Indices of ``reads`` in at most ``num_groups`` non-empty groups of about equal bytes (each read whole, the
    largest first into the lightest group), each group in the reads' order."""
    if num_groups <= 1 or len(reads) <= 1:
        return [list(range(len(reads)))]
    groups: list[list[int]] = [[] for _ in range(min(num_groups, len(reads)))]
    loads = [0] * len(groups)
    for i in sorted(range(len(reads)), key=lambda i: -reads[i].length):
        g = loads.index(min(loads))
        groups[g].append(i)
        loads[g] += reads[i].length
    return [sorted(g) for g in groups]


def _value_groups(sizes_bytes: Sequence[int], max_value_bytes: int) -> list[list[int]]:
    """Split objects (in order) into stripes whose value stays within ``max_value_bytes``; an object larger than
    the limit gets a stripe of its own (its write then fails: that object is not stored)."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes_bytes):
        if not groups or total + n > max_value_bytes:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def _distinct(backends: Sequence[Backend]) -> list[Backend]:
    return list({id(b): b for b in backends}.values())
