"""In-process DRAM tier: the reference implementation of the stripe-store protocol and the test oracle.

Stripes live in this process (a worker process when serving); ``capacity_bytes`` is enforced by evicting the least
recently used stripes that hold no lease, with the tickets that still point at them. Thread-safe.

A worker's DRAM tier keeps an evicted stripe readable (``retain_evicted``) until the scheduler has learnt of the
eviction: its index lives in the scheduler, which with asynchronous scheduling plans the next step's loads before it
processes the report of the step whose saves evicted the stripe. Its tickets are gone at once (nothing new finds
it). Its bytes leave the budget and are held beside it, at most ``capacity_bytes`` more (oldest freed first past
that), until the worker frees them (:meth:`MemoryBackend.free_retired`), one or two engine steps later: the tier's
memory is at most twice its budget for that long.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence

from range_connector.backends.base import Backend, RangeRead, ScatterDest, StripeWrite


class MemoryBackend(Backend):
    """A stripe store in this process's memory (lends stripes to loads without copying: ``supports_views``).

    Args:
        capacity_bytes: byte budget (``None``: unlimited).
        name: label for error messages.
        max_value_bytes: largest accepted layer value (default 2 GiB).
        clock: monotonic seconds, on which leases expire (tests pass a virtual one).
        retain_evicted: keep evicted stripes readable until :meth:`free_retired` (module docstring).
    """

    def __init__(self, capacity_bytes: int | None = None, name: str = "memory",
                 max_value_bytes: int = 2 << 30, *, clock: Callable[[], float] = time.monotonic,
                 retain_evicted: bool = False) -> None:
        super().__init__(name, max_value_bytes, capacity_bytes)
        self._clock = clock
        self.supports_views = True
        self.supports_scatter = True
        self._stripes: OrderedDict[str, list[bytes]] = OrderedDict()  # LRU order, oldest first
        self._stripe_tickets: dict[str, list[bytes]] = {}
        self._tickets: dict[bytes, tuple[str, bytes]] = {}  # key -> (stripe id, encoded ticket)
        self._leases: dict[str, dict[str, float]] = {}  # stripe id -> {lease token: expiry (on the clock)}
        self._used_bytes = 0
        self._lock = threading.Lock()
        #: ticket keys dropped by eviction since the last :meth:`take_evicted` (a scheduler-side index learns them).
        self._evicted: list[bytes] = []
        #: called after a write evicted a stripe, outside the lock, with ``(stripe id, [num_layers] layer values,
        #: [(ticket key, encoded ticket)])``: a tier hierarchy in write-back demotes it to the next tier
        self.on_evict: Callable[[str, list[bytes], list[tuple[bytes, bytes]]], None] | None = None
        self._just_evicted: list[tuple[str, list[bytes], list[tuple[bytes, bytes]]]] = []
        self.retain_evicted = retain_evicted
        #: evicted stripes still readable, oldest first: stripe id -> (layer values, stamp of the eviction's report
        #: or None before :meth:`take_evicted` reported it); their bytes are not in ``used_bytes``
        self._retired: OrderedDict[str, tuple[list[bytes], int | None]] = OrderedDict()
        self._retired_bytes = 0
        #: retired stripes freed before the scheduler learnt of them, past the ``capacity_bytes`` held beside the
        #: budget (a load promised from one fails and is recomputed)
        self.retired_freed_early = 0

    def used_bytes(self) -> int:
        return self._used_bytes

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._count(round_trips=1, commands=1)
        with self._lock:
            return [t[1] if (t := self._tickets.get(k)) is not None else None for k in keys]

    def _leased(self, stripe_id: str, now: float) -> bool:
        live = {tok: t for tok, t in self._leases.get(stripe_id, {}).items() if t > now}
        if live:
            self._leases[stripe_id] = live
        else:
            self._leases.pop(stripe_id, None)
        return bool(live)

    def _retire(self, stripe_id: str, values: list[bytes], nbytes: int) -> None:
        self._retired[stripe_id] = (values, None)
        self._retired_bytes += nbytes
        while self._retired_bytes > (self.capacity_bytes or 0):
            self._retired_bytes -= sum(len(v) for v in self._retired.popitem(last=False)[1][0])
            self.retired_freed_early += 1

    def _evict_for(self, need_bytes: int) -> bool:
        if self.capacity_bytes is None:
            return True
        if need_bytes > self.capacity_bytes:
            return False
        now = self._clock()
        for stripe_id in list(self._stripes):
            if self._used_bytes + need_bytes <= self.capacity_bytes:
                break
            if self._leased(stripe_id, now):
                continue
            values = self._stripes.pop(stripe_id)
            nbytes = sum(len(v) for v in values)
            self._used_bytes -= nbytes
            if self.retain_evicted:
                self._retire(stripe_id, values, nbytes)
            tickets = []
            for key in self._stripe_tickets.pop(stripe_id, ()):
                if self._tickets.get(key, ("",))[0] == stripe_id:
                    tickets.append((key, self._tickets.pop(key)[1]))
                    self._evicted.append(key)
            if self.on_evict is not None and tickets:
                self._just_evicted.append((stripe_id, values, tickets))
        return self._used_bytes + need_bytes <= self.capacity_bytes

    def _values(self, stripe_id: str) -> list[bytes] | None:
        """A stored stripe's layer values, most recently used now; a retired one's (not made recent again)."""
        values = self._stripes.get(stripe_id)
        if values is not None:
            self._stripes.move_to_end(stripe_id)
            return values
        retired = self._retired.get(stripe_id)
        return None if retired is None else retired[0]

    def write_stripe(self, write: StripeWrite) -> bool:
        self._check_write(write)
        need = write.nbytes
        with self._lock:
            room = self._evict_for(need)
            if room:
                values = [bytes(v) for v in write.layer_values]
                self._stripes[write.stripe_id] = values
                self._stripe_tickets[write.stripe_id] = [k for k, _ in write.tickets]
                self._used_bytes += need
                for key, raw in write.tickets:
                    self._tickets[key] = (write.stripe_id, bytes(raw))
            evicted, self._just_evicted = self._just_evicted, []
        for stripe_id, evicted_values, tickets in evicted:
            self.on_evict(stripe_id, evicted_values, tickets)  # type: ignore[misc]
        if not room:
            self._count(round_trips=1, commands=1)
            return False
        # One command per layer value and one for all the tickets (an MSET on Valkey): the cost of a write follows
        # layers and bytes, not the number of chunks (docs/architecture.md, principle 1).
        self._count(round_trips=1, commands=len(values) + bool(write.tickets), bytes_written=need,
                    allocations=len(values))
        return True

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        out = []
        nbytes = 0
        for r in reads:  # the same checks as the remote tiers, whatever the stored value holds
            if r.length < 1 or r.offset < 0 or r.offset + r.length > r.value_bytes or r.dest.nbytes != r.length:
                raise ValueError(f"{self.name}: read [{r.offset}, {r.offset + r.length}) into a {r.dest.nbytes}-byte "
                                 f"dest is outside stripe {r.stripe_id} layer {r.layer_idx} of {r.value_bytes} bytes")
        with self._lock:
            for r in reads:
                values = self._values(r.stripe_id)
                if values is None or not 0 <= r.layer_idx < len(values):
                    out.append(False)
                    continue
                value = values[r.layer_idx]
                if r.offset < 0 or r.length != r.dest.nbytes or r.offset + r.length > len(value):
                    raise ValueError(f"{self.name}: read [{r.offset}, {r.offset + r.length}) of stripe "
                                     f"{r.stripe_id} layer {r.layer_idx} is outside its {len(value)} bytes")
                if isinstance(r.dest, ScatterDest):
                    r.dest.fill_from(memoryview(value)[r.offset:r.offset + r.length])
                else:
                    r.dest[:] = memoryview(value)[r.offset:r.offset + r.length]
                nbytes += r.length
                out.append(True)
        self._count(round_trips=1, commands=len(reads), bytes_read=nbytes, copy_launches=len(reads))
        return out

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        out: list[list[memoryview] | None] = []
        with self._lock:
            for sid in stripe_ids:
                values = self._values(sid)
                out.append(None if values is None else [memoryview(v) for v in values])
        self._count(round_trips=1, commands=len(stripe_ids))
        return out

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        expiry = self._clock() + ttl_s
        token = uuid.uuid4().hex
        with self._lock:
            for sid in stripe_ids:
                self._leases.setdefault(sid, {})[token] = expiry
                if sid in self._stripes:  # a lease is a use (as on Valkey): the stripe becomes the most recent
                    self._stripes.move_to_end(sid)
        self._count(round_trips=1, commands=len(stripe_ids))
        return token

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        with self._lock:
            for sid in stripe_ids:
                held = self._leases.get(sid)
                if held:
                    held.pop(token if token is not None else min(held, key=held.__getitem__), None)
                    if not held:
                        del self._leases[sid]
        self._count(round_trips=1, commands=len(stripe_ids))

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._tickets.pop(k, None)
        self._count(round_trips=1, commands=1)

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        with self._lock:
            for sid in stripe_ids:
                retired = self._retired.pop(sid, None)
                if retired is not None:
                    self._retired_bytes -= sum(len(v) for v in retired[0])
                values = self._stripes.pop(sid, None)
                if values is None:
                    continue
                self._used_bytes -= sum(len(v) for v in values)
                for key in self._stripe_tickets.pop(sid, ()):
                    if self._tickets.get(key, ("",))[0] == sid:
                        del self._tickets[key]
                        self._evicted.append(key)
        self._count(round_trips=1, commands=len(stripe_ids))

    def clear(self) -> None:
        # One step under the lock: a write is either wholly before it (and removed) or wholly after it.
        with self._lock:
            self._stripes.clear()
            self._stripe_tickets.clear()
            self._tickets.clear()
            self._leases.clear()
            self._retired.clear()
            self._retired_bytes = 0
            self._used_bytes = 0
            self._evicted = []
        self._count(round_trips=1, commands=1)

    def ping(self) -> None:
        self._count(round_trips=1, commands=1)

    def num_leases(self) -> int:
        """Live leases held (for tests and metrics)."""
        now = self._clock()
        with self._lock:
            return sum(1 for sid in list(self._leases) if self._leased(sid, now) for _ in self._leases.get(sid, ()))

    def take_evicted(self, stamp: int | None = None) -> list[bytes]:
        """Return and forget the ticket keys dropped by eviction since the last call.

        Args:
            stamp: the report that carries them (the worker's step index): the stripes retired since the last call
                are freed by :meth:`free_retired` once the scheduler has learnt this report (``None``: at once).
        """
        with self._lock:
            out, self._evicted = self._evicted, []
            for sid, (values, was) in list(self._retired.items()):
                if was is None:
                    if stamp is None:
                        del self._retired[sid]
                        self._retired_bytes -= sum(len(v) for v in values)
                    else:
                        self._retired[sid] = (values, stamp)
        return out

    def free_retired(self, learnt_through: int) -> int:
        """Free the retired stripes whose eviction was reported in a report the scheduler has learnt (stamp at or
        below ``learnt_through``, :attr:`~range_connector.kv.metadata.RangeConnectorMetadata.reports_learnt_through`);
        returns how many."""
        with self._lock:
            gone = [sid for sid, (_, was) in self._retired.items() if was is not None and was <= learnt_through]
            for sid in gone:
                values, _ = self._retired.pop(sid)
                self._retired_bytes -= sum(len(v) for v in values)
        return len(gone)

    def num_retired(self) -> int:
        """Evicted stripes still readable (for tests and metrics)."""
        with self._lock:
            return len(self._retired)

    def retired_bytes(self) -> int:
        """Bytes of the evicted stripes still readable, held beside the budget (at most ``capacity_bytes``)."""
        return self._retired_bytes
