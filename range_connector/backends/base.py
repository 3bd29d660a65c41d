"""The backend protocol: one shard's stripe store, addressed by stripe ids and ticket keys.

A save batch becomes one *stripe* per shard: for every layer one value ``[num_planes, stripe_blocks, row_bytes]``
(on Valkey a value of its own, read whole; sub-ranges only for partial hits), plus one small *ticket* per chunk
(:mod:`range_connector.kv.tickets`). Every operation below is one round trip whatever the number of chunks or layers
it covers, so the cost of the storage path follows bytes and stripes, not logical objects (docs/architecture.md,
principle 1).

Contract (checked by ``tests/backends/test_conformance_*.py`` against every backend):

* ``write_stripe`` stores the layer values, then publishes the tickets; a reader that sees a ticket can read its
  stripe. When ``capacity_bytes`` is set, room is made by evicting least-recently-used stripes that hold no lease,
  together with the tickets that still point at them; if that is not enough, the write is skipped (``False``).
* ``get_tickets`` returns the raw ticket bytes (``None`` for a miss): one round trip, one command on Valkey (MGET).
* ``read_ranges`` fills each read's ``dest`` with ``length`` bytes of a stripe's layer value; a stripe that is gone
  reads as ``False`` (a miss), never as garbage. A tier with ``supports_scatter`` also takes a
  :class:`ScatterDest`: the bytes go, in order, into several buffers that the caller owns (the rows of the KV
  cache), each write made inside the destination's gate; a gate that refuses ends the call with
  :class:`BackendError` and nothing more is written.
* ``drop_stripes`` removes stripes with their tickets and bytes (a tool's own stripes; leases are not checked).
* ``lease`` protects stripes from eviction for ``ttl_s`` seconds (or until ``release``) and returns a token; each
  holder releases its own lease by token (two holders need two releases, and a holder whose lease expired cannot
  release another's); an expired lease protects nothing.
* ``clear`` removes every entry of the backend's deployment (stripes, tickets, leases, the byte count) and fences
  the writes in flight: a write that began before ``clear`` and ends after it stores nothing (``False``). Another
  deployment's entries on the same server or directory are untouched.
* Every call has a deadline: :class:`BackendTimeoutError` when it passes, :class:`BackendError` for other failures.
* :class:`BackendCounters` count round trips, commands, bytes, allocations, copy launches (client side) and saves
  skipped because the storage was full.
"""

from __future__ import annotations

import abc
import contextlib
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from range_connector.config.keys import DEPLOYMENT_PATTERN
from range_connector.errors import BackendError

Buffer = bytes | bytearray | memoryview

#: The storage format, part of every key and directory a shared tier lays out: ``rc3`` added the deployment
#: (Valkey keys ``rc3:<deployment>:...``, file tier ``<directory>/<deployment>/shard-<s>``); entries of older
#: formats are never read.
STORAGE_FORMAT = "rc3"


def deployment_key_prefix(deployment: str) -> str:
    """The prefix of every key a deployment stores on a key-value tier: ``rc3:<deployment>:``.

    Raises:
        ValueError: ``deployment`` is not a valid name (``config.keys.DEPLOYMENT_PATTERN``).
    """
    if not re.fullmatch(DEPLOYMENT_PATTERN, deployment):
        raise ValueError(f"deployment {deployment[:80]!r} does not match {DEPLOYMENT_PATTERN}")
    return f"{STORAGE_FORMAT}:{deployment}:"


@dataclass(slots=True)
class BackendCounters:
    """Cumulative work done by one backend instance (client side)."""

    round_trips: int = 0
    commands: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    allocations: int = 0
    copy_launches: int = 0
    #: saves skipped because the tier's storage was full (a file system answering ``ENOSPC`` or ``EDQUOT``)
    saves_skipped_no_space: int = 0

    def snapshot(self) -> dict[str, int]:
        """Return the counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ScatterDest:
    """A read's destination made of several writable buffers filled in order (their sizes add up to the read's
    length): the rows of the KV cache that the bytes belong in, so that nothing is staged and copied again.

    The buffers belong to someone else (a load job that may be cancelled at any time, after which the blocks may
    belong to another request). Every write into them happens inside ``gate``, a context manager held only while
    bytes move (never while waiting for the tier); entering it raises :class:`~range_connector.errors.BackendError`
    once the owner has closed it, which ends the read there.

    Attributes:
        pieces: ``[num_pieces]`` flat writable byte views.
        gate: context manager entered around every write into ``pieces``.
        digest: a running checksum (an ``xxhash.xxh3_64()`` or any object with ``update(bytes-like)``) that the tier
            updates, in order, with every byte it lands in the pieces, read back from the pieces right after they
            landed (while still in cache), so that the caller need not read the bytes again to verify them;
            ``None``: none.
    """

    pieces: tuple[memoryview, ...]
    gate: contextlib.AbstractContextManager
    digest: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes the pieces hold together."""
        return sum(p.nbytes for p in self.pieces)

    def fill_from(self, data: Buffer) -> None:
        """Copy ``data`` (at most :attr:`nbytes` bytes) into the pieces in order, inside the gate (then update the
        digest from the pieces)."""
        src = memoryview(data).cast("B")
        pos = 0
        with self.gate:
            for piece in self.pieces:
                if pos >= src.nbytes:
                    break
                n = min(piece.nbytes, src.nbytes - pos)
                piece[:n] = src[pos:pos + n]
                pos += n
        if self.digest is not None:
            for piece in self.pieces:
                self.digest.update(piece[:min(piece.nbytes, pos)])
                pos -= piece.nbytes
                if pos <= 0:
                    break


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Read ``length`` bytes at ``offset`` of layer ``layer_idx`` of a stripe into ``dest`` (exactly ``length``
    bytes, writable; a :class:`ScatterDest` only for tiers with ``supports_scatter``). ``value_bytes`` is the size
    of the whole layer value (from the ticket): a read of all of it is a whole-value read (``GET`` on Valkey, which
    the server answers without copying a sub-range)."""

    stripe_id: str
    layer_idx: int
    offset: int
    length: int
    value_bytes: int
    dest: memoryview | ScatterDest


@dataclass(frozen=True, slots=True)
class StripeWrite:
    """One shard's part of one save batch.

    Attributes:
        stripe_id: unique id (alphanumeric).
        layer_values: ``[num_layers]`` buffers of equal size, ``[num_planes, stripe_blocks, row_bytes]`` each.
        tickets: ``(ticket key, encoded ticket)`` of every chunk in the stripe.
        epoch: the shared tier's reset epoch the save was gathered in (:attr:`Backend.epoch_hint` then), or
    tiers: tuple[int, ...] | None = None
            ``None``: the tier's epoch when the write reserves its stripe. A write gathered in an older epoch than the
            tier's stores nothing (a reset came between the gathering and the write). (A tier hierarchy's hint is
            one epoch per tier: :class:`~range_connector.backends.tiered.TieredBackend`.)
        tiers: in a tier hierarchy, the tiers to write (indices, nearest first); ``None``: all of them.
    """

    stripe_id: str
    layer_values: Sequence[Buffer]
    tickets: Sequence[tuple[bytes, bytes]]
    epoch: int | None = None
    tiers: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the layer values (what counts against ``capacity_bytes``)."""
        return sum(memoryview(v).nbytes for v in self.layer_values)


class Backend(abc.ABC):
    """One shard's stripe store.

    Attributes:
        name: tier and address for error messages (e.g. ``valkey://127.0.0.1:6379``).
        max_value_bytes: the largest single layer value the tier accepts.
        capacity_bytes: byte budget managed by Range (``None``: no budget).
        counters: cumulative :class:`BackendCounters`.
    """

    #: Whether the bytes outlive the process that wrote them (other processes and restarted engines see them).
    is_shared: bool = False
    #: Whether :meth:`view_stripes` can lend stored stripes without copying (in-process tiers).
    supports_views: bool = False
    #: Whether :meth:`read_ranges` takes :class:`ScatterDest` destinations (reads straight into the KV cache).
    supports_scatter: bool = False

    def __init__(self, name: str, max_value_bytes: int, capacity_bytes: int | None) -> None:
        self.name = name
        self.max_value_bytes = max_value_bytes
        self.capacity_bytes = capacity_bytes
        self.counters = BackendCounters()
        self._counters_lock = threading.Lock()

    def _count(self, **deltas: int) -> None:
        with self._counters_lock:
            for k, v in deltas.items():
                setattr(self.counters, k, getattr(self.counters, k) + v)

    @abc.abstractmethod
    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Read tickets (one round trip). Raises BackendTimeoutError, BackendError."""

    @abc.abstractmethod
    def write_stripe(self, write: StripeWrite) -> bool:
        """Store a stripe and publish its tickets (see the module contract).

        Returns:
            ``True`` if stored, ``False`` if skipped for lack of room (everything evictable is leased, the
            stripe is larger than the budget, or the tier's storage is full: counted in
            ``counters.saves_skipped_no_space``).

        Raises:
            ValueError: a layer value exceeds :attr:`max_value_bytes` (nothing is stored).
            BackendTimeoutError, BackendError.
        """

    @abc.abstractmethod
    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        """Fill every read's ``dest`` (one round trip); ``False`` where the stripe or layer is gone.

        Raises:
            ValueError: a read falls outside its stored value (a ticket that lies; caller treats as corrupt).
            BackendTimeoutError, BackendError.
        """

    @abc.abstractmethod
    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        """Protect stripes from eviction for ``ttl_s`` seconds (one round trip).

        Returns:
            The lease's token: :meth:`release` with it removes exactly this lease, never another holder's.
        """

    @abc.abstractmethod
    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        """Release a lease on each stripe (one round trip): the lease ``token`` names (harmless if it expired or
        was released), or without a token the one that expires first. Releasing an expired lease is harmless."""

    @abc.abstractmethod
    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        """Forget chunks whose bytes proved bad (one round trip); their stripes age out by LRU."""

    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes of stripes currently stored (as accounted by Range)."""

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        """Remove stripes and the tickets that still point at them, leased or not (one round trip); unknown ids
        are ignored. For tools that remove what they wrote themselves (``range-connector calibrate``).

        Raises:
            BackendTimeoutError, BackendError.
        """
        raise NotImplementedError(f"{self.name} cannot drop stripes")

    #: shared tiers: the deployment's reset epoch as this instance last saw it (read at construction, after a refused
    #: write and by :meth:`refresh_epoch`); stamped on each save when it is gathered (``StripeWrite.epoch``).
    #: ``None``: the tier has no epochs (in-process tiers are cleared by their own worker).
    epoch_hint: int | None = None

    def refresh_epoch(self) -> None:
        """Read the tier's reset epoch into :attr:`epoch_hint` (after a reset). Never raises: a tier that does not
        answer keeps its hint (its writes are then refused once, and the hint corrected)."""

    def clear(self) -> None:
        """Remove every entry of this backend's deployment on the shard: stripes, tickets, leases and the byte
        count, leased or not; writes in flight when it is called store nothing. Other deployments' entries stay.

        Each round trip has the tier's deadline; the number of round trips grows with the entries removed (about one
        per thousand keys on Valkey).

        Raises:
            BackendTimeoutError, BackendError: the tier could not be cleared (some entries may remain).
        """
        raise NotImplementedError(f"{self.name} cannot clear")

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        """Lend read-only views of stored stripes, ``[num_layers]`` layer values each (``None``: gone).

        Only for tiers with :attr:`supports_views`; the views stay valid after eviction (the tier drops its
        reference, not the bytes). One round trip.
        """
        raise NotImplementedError(f"{self.name} cannot lend views")

    def serves_views(self, stripe_id: str) -> bool:
        """Whether :meth:`view_stripes` can lend this stripe (a tier hierarchy answers per stripe)."""
        return self.supports_views

    def serves_device_reads(self, stripe_id: str) -> bool:
        """Whether a load may read this stripe straight into device memory (``read_ranges_device(reads)``, each
        ``dest`` a device buffer): the file tier after a GPUDirect probe that passed; no other tier."""
        return False

    def read_ranges_device(self, reads: Sequence[Any]) -> list[bool]:
        """:meth:`read_ranges` into device memory, where :meth:`serves_device_reads` says so (the file tier's
        ``DeviceRead`` reads); elsewhere it raises :class:`~range_connector.errors.BackendError`."""
        raise BackendError(f"{self.name}: no reads into device memory")

    def serves_scatter(self, stripe_id: str) -> bool:
        """Whether a read of this stripe takes a :class:`ScatterDest` (a tier hierarchy answers per stripe)."""
        return self.supports_scatter

    def ping(self) -> None:
        """Check that the tier answers. Raises BackendTimeoutError, BackendError."""

    def close(self) -> None:
        """Release connections; stored bytes stay where the tier keeps them."""

    def _check_write(self, write: StripeWrite) -> None:
        sizes = {memoryview(v).nbytes for v in write.layer_values}
        if len(sizes) > 1:
            raise ValueError(f"{self.name}: stripe {write.stripe_id} has layer values of different sizes {sizes}")
        if sizes and max(sizes) > self.max_value_bytes:
            raise ValueError(f"{self.name}: stripe {write.stripe_id} layer value of {max(sizes)} bytes is over the "
                             f"tier's limit of {self.max_value_bytes} bytes")
        if not write.stripe_id.isalnum():
            raise ValueError(f"{self.name}: stripe id {write.stripe_id!r} is not alphanumeric")
