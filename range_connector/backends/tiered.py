"""One shard of a tier hierarchy as one backend: the nearest tier first, each stripe read from the tier that holds it.

The scheduler's lookup (:class:`~range_connector.scheduler.tiers.TieredLookup`) asks the tiers nearest first and
*tags* the stripe id of every ticket a farther tier answers with its tier: ``"T<i>"`` before the id (stripe ids are
lowercase hex, :func:`~range_connector.kv.stripes.new_stripe_id`, so a tag cannot be mistaken for one and stays
alphanumeric). A ticket without a tag is the nearest tier's. :class:`TieredBackend` routes every call that names
stripes (reads, views, leases, drops) to the tier of each id, with the tag taken off; tier backends never see tags.

Writes go through by default: a stripe is written to the nearest tier, then to each farther one (``far_writes``:
``"async"``, on this shard's far-writer thread once the nearest write returned, at most ``max_backlog_bytes``
waiting, past which a far copy is skipped, counted by tier and logged; an empty backlog always takes one write,
however large, so that a stripe bigger than the bound is still written through; ``"sync"``: before
:meth:`TieredBackend.write_stripe` returns, for a producer whose announcement must point at shared storage). A write may name the tiers it goes to
(``StripeWrite.tiers``: a promotion writes the nearest tier only). The stripe keeps one id on every tier, so a far
tier's copy needs no other ticket. With ``write_back`` a save writes the nearest tier only, and a stripe the DRAM
tier evicts is written to the next tier then (a *demotion*; not for a stripe that was promoted from there).

On the scheduler side the DRAM tier lives in the workers: its slot is ``None`` here and calls for its stripes do
nothing (its loads need no lease).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.errors import BackendError

logger = logging.getLogger("vllm." + __name__)

#: the tag of a farther tier's stripe id: ``T`` then the tier's index (1-9)
TIER_TAG = "T"


def tag_stripe(tier: int, stripe_id: str) -> str:
    """``stripe_id`` as tier ``tier`` holds it, tagged (tier 0's ids are not tagged)."""
    return stripe_id if tier == 0 else f"{TIER_TAG}{tier}{stripe_id}"


def stripe_tier(stripe_id: str) -> tuple[int, str]:
    """``(tier, the id on that tier)`` of a possibly tagged stripe id."""
    if len(stripe_id) > 2 and stripe_id[0] == TIER_TAG and stripe_id[1].isdigit():
        return int(stripe_id[1]), stripe_id[2:]
    return 0, stripe_id


def tickets_tier(tickets) -> int:
    """The tier a chunk's ``[num_groups * num_shards]`` tickets are read from: the first ticket's tag (a ticket in
    pieces: its first piece's); 0 without tickets."""
    first = tickets[0] if tickets else None
    if isinstance(first, tuple):
        first = first[0] if first else None
    return stripe_tier(first.stripe_id)[0] if first is not None else 0


def leaf_backends(backends: Iterable[Backend]) -> list[Backend]:
    """The distinct backends under ``backends`` (a :class:`TieredBackend`'s tiers in its place), in order."""
    out: dict[int, Backend] = {}
    for b in backends:
        for leaf in (b.tiers if isinstance(b, TieredBackend) else (b,)):
            if leaf is not None:
                out.setdefault(id(leaf), leaf)
    return list(out.values())


class TieredBackend(Backend):
    """One shard's tiers, nearest first, behind the backend protocol.

    Args:
        tiers: ``[num_tiers]`` this shard's backend of each tier, or ``None`` for a tier that lives in another
            process (the DRAM tier, seen from the scheduler).
        far_writes: ``"async"`` or ``"sync"`` (see the module docstring).
        max_backlog_bytes: layer bytes of far writes waiting at most (``"async"``).
        write_back: saves write the nearest tier only; a stripe the DRAM tier evicts is written to the next tier
            then (:meth:`demote`), unless it came from there (a promotion).

    Attributes:
        far_writes_skipped: far copies not written because the backlog was full or the write failed (all tiers;
            :meth:`take_far_copies_skipped` has them by tier).
        write_observer: called ``(tier index, seconds)`` after each tier's stripe write returned (the near one in
            :meth:`write_stripe`, far ones where they run); the worker's saver sets it (histogram ``save_seconds``).
    """

    def __init__(self, tiers: Sequence[Backend | None], *, far_writes: str = "async",
                 max_backlog_bytes: int = 256 << 20, write_back: bool = False) -> None:
        present = [t for t in tiers if t is not None]
        if not present or len(tiers) > 9:
            raise ValueError(f"a tier hierarchy needs 1-9 tiers with at least one here, got {len(tiers)}")
        super().__init__("+".join(t.name if t is not None else "(elsewhere)" for t in tiers),
                         min(t.max_value_bytes for t in present), None)
        if far_writes not in ("async", "sync"):
            raise ValueError(f"far_writes {far_writes!r} is not 'async' or 'sync'")
        self.tiers = list(tiers)
        self.far_writes = far_writes
        self.max_backlog_bytes = max_backlog_bytes
        self.is_shared = any(t.is_shared for t in present)
        self.supports_views = all(t.supports_views for t in present)
        self.supports_scatter = all(t.supports_scatter for t in present)
        self.counters = present[0].counters  # (the nearest tier's: its result is write_stripe's)
        self.far_writes_skipped = 0
        self._skipped_by_tier: dict[int, int] = defaultdict(int)  # since the last take
        self._next_skip_log_s = 0.0
        self.write_back = write_back
        self._demoted: set[bytes] = set()  # chunk hashes (hex, from the ticket keys) demoted since the last take
        #: stripes written to the nearest tier only because a farther one holds them (promotions): not demoted
        self._from_far: set[str] = set()
        self._backlog_bytes = 0
        self._lock = threading.Lock()
        self._far = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-far-write")
        self._pending: set = set()
        self.write_observer: Callable[[int, float], None] | None = None

    # ------------------------------------------------------------------ routing
    def _tier(self, i: int) -> Backend | None:
        return self.tiers[i] if 0 <= i < len(self.tiers) else None

    def _by_tier(self, stripe_ids: Sequence[str]) -> dict[int, list[tuple[int, str]]]:
        """``tier -> [(position in stripe_ids, untagged id)]``."""
        out: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for pos, sid in enumerate(stripe_ids):
            tier, bare = stripe_tier(sid)
            out[tier].append((pos, bare))
        return out

    def serves_views(self, stripe_id: str) -> bool:
        tier = self._tier(stripe_tier(stripe_id)[0])
        return tier is not None and tier.serves_views(stripe_tier(stripe_id)[1])

    def serves_scatter(self, stripe_id: str) -> bool:
        tier = self._tier(stripe_tier(stripe_id)[0])
        return tier is not None and tier.serves_scatter(stripe_tier(stripe_id)[1])

    # ------------------------------------------------------------------ protocol
    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The nearest present tier's tickets (the scheduler's lookup asks each tier itself, nearest first)."""
        return next(t for t in self.tiers if t is not None).get_tickets(keys)

    @property
    def epoch_hint(self) -> tuple[int | None, ...]:  # type: ignore[override]
        """Each tier's reset epoch hint (a save stamps all of them; each tier checks its own)."""
        return tuple(t.epoch_hint if t is not None else None for t in self.tiers)

    def refresh_epoch(self) -> None:
        for t in self.tiers:
            if t is not None:
                t.refresh_epoch()

    def _for_tier(self, write: StripeWrite, i: int) -> StripeWrite:
        epoch = write.epoch[i] if isinstance(write.epoch, tuple) else write.epoch
        return dataclasses.replace(write, epoch=epoch, tiers=None)

    def write_stripe(self, write: StripeWrite) -> bool:
        """Write the nearest named tier now and the farther ones as ``far_writes`` says.

        Returns:
            Whether the nearest tier stored it (``"sync"``: and every far tier too).

        Raises:
            ValueError, BackendTimeoutError, BackendError: from the nearest tier (far tiers' errors are logged and
            counted in :attr:`far_writes_skipped`; with ``"sync"`` they make the result ``False``).
        """
        targets = [i for i, t in enumerate(self.tiers) if t is not None and (write.tiers is None or i in write.tiers)]
        if not targets:
            return False
        near, far = targets[0], targets[1:]
        if self.write_back and write.tiers is None:
            far = []  # (written to a far tier when the near one evicts it)
        elif self.write_back and write.tiers is not None:  # (dropped again when DRAM evicts it: bounded)
            with self._lock:
                self._from_far.add(write.stripe_id)
        start_s = time.monotonic()
        stored = self.tiers[near].write_stripe(self._for_tier(write, near))  # type: ignore[union-attr]
        self._observe(near, start_s)
        if not stored or not far:
            return stored
        if self.far_writes == "sync":
            return all([self._write_far(write, i) for i in far])
        nbytes = write.nbytes * len(far)
        with self._lock:
            if not self._admit_locked(nbytes, far):
                return stored
            self._backlog_bytes += nbytes
        fut = self._far.submit(self._write_far_all, write, far, nbytes)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return stored

    def _write_far_all(self, write: StripeWrite, far: list[int], nbytes: int) -> None:
        try:
            for i in far:
                self._write_far(write, i)
        finally:
            with self._lock:
                self._backlog_bytes -= nbytes

    def _write_far(self, write: StripeWrite, i: int) -> bool:
        tier = self.tiers[i]
        assert tier is not None
        try:
            start_s = time.monotonic()
            stored = tier.write_stripe(self._for_tier(write, i))
            self._observe(i, start_s)
            if stored:
                return True
        except (BackendError, ValueError) as exc:
            logger.warning("Range save to %s failed: %s", tier.name, exc)
        with self._lock:
            self.far_writes_skipped += 1
            self._skipped_by_tier[i] += 1
        return False

    def _admit_locked(self, nbytes: int, far: list[int]) -> bool:
        """Whether ``nbytes`` more of far writes (to tiers ``far``) fit the backlog; an empty backlog takes any one
        write (a stripe bigger than the bound would otherwise never be written through). A refusal is counted by
        tier and logged at most once a minute. Call with the lock held."""
        if self._backlog_bytes == 0 or self._backlog_bytes + nbytes <= self.max_backlog_bytes:
            return True
        self.far_writes_skipped += len(far)
        for i in far:
            self._skipped_by_tier[i] += 1
        now = time.monotonic()
        if now >= self._next_skip_log_s:
            self._next_skip_log_s = now + 60.0
            logger.warning("Range %s: far copies skipped, %d bytes of far writes already waiting (save_backlog_bytes "
                           "%d); these stripes stay in the nearest tier only (metric "
                           "vllm:range_tier_far_copies_skipped_total)", self.name, self._backlog_bytes,
                           self.max_backlog_bytes)
        return False

    def take_far_copies_skipped(self) -> dict[int, int]:
        """Far copies skipped (backlog full or write failed) since the last call, by tier index."""
        with self._lock:
            out, self._skipped_by_tier = dict(self._skipped_by_tier), defaultdict(int)
        return out

    def _observe(self, tier_idx: int, start_s: float) -> None:
        observer = self.write_observer
        if observer is not None:
            observer(tier_idx, time.monotonic() - start_s)

    def demote(self, stripe_id: str, layer_values: list[bytes], tickets: list[tuple[bytes, bytes]]) -> None:
        """The nearest tier evicted a stripe of this shard: with ``write_back``, write it to the next tier on the
        far-writer thread (within the backlog), unless it came from there; never raises."""
        with self._lock:
            came_from_far = stripe_id in self._from_far
            self._from_far.discard(stripe_id)
        nxt = next((i for i in range(1, len(self.tiers)) if self.tiers[i] is not None), None)
        if not self.write_back or came_from_far or nxt is None:
            return
        write = StripeWrite(stripe_id, layer_values, tickets)
        nbytes = write.nbytes
        with self._lock:
            if not self._admit_locked(nbytes, [nxt]):
                return
            self._backlog_bytes += nbytes
            self._demoted.update(key.split(b":")[1] for key, _ in tickets)
        fut = self._far.submit(self._write_far_all, write, [nxt], nbytes)
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)

    def take_demoted(self) -> set[bytes]:
        """The chunks (hex chunk hashes) demoted since the last call."""
        with self._lock:
            out, self._demoted = self._demoted, set()
        return out

    def wait_far_writes(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the far writes queued so far; whether all ended."""
        pending = list(self._pending)
        return not wait(pending, timeout=timeout_s).not_done if pending else True

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        out = [False] * len(reads)
        for tier_idx, items in self._by_tier([r.stripe_id for r in reads]).items():
            tier = self._tier(tier_idx)
            if tier is None:
                raise BackendError(f"{self.name}: no tier {tier_idx} here for {len(items)} read(s)")
            got = tier.read_ranges([dataclasses.replace(reads[pos], stripe_id=bare) for pos, bare in items])
            for (pos, _), ok in zip(items, got):
                out[pos] = ok
        return out

    def view_stripes(self, stripe_ids: Sequence[str]) -> list[list[memoryview] | None]:
        out: list[list[memoryview] | None] = [None] * len(stripe_ids)
        for tier_idx, items in self._by_tier(stripe_ids).items():
            tier = self._tier(tier_idx)
            if tier is None:
                continue
            for (pos, _), got in zip(items, tier.view_stripes([bare for _, bare in items])):
                out[pos] = got
        return out

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        """One lease per tier involved; the token lists them (``"<tier>=<token>"``, comma-separated)."""
        tokens = []
        for tier_idx, items in sorted(self._by_tier(stripe_ids).items()):
            tier = self._tier(tier_idx)
            if tier is not None:
                tokens.append(f"{tier_idx}={tier.lease([bare for _, bare in items], ttl_s)}")
        return ",".join(tokens)

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        by_tier_token = dict(part.split("=", 1) for part in token.split(",") if "=" in part) if token else {}
        for tier_idx, items in self._by_tier(stripe_ids).items():
            tier = self._tier(tier_idx)
            if tier is not None:
                tier.release([bare for _, bare in items], by_tier_token.get(str(tier_idx)) if token else None)

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        """Delete on every tier here (a chunk proved bad on one tier is as suspect on the others)."""
        for t in self.tiers:
            if t is not None:
                t.delete_tickets(keys)

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        for tier_idx, items in self._by_tier(stripe_ids).items():
            tier = self._tier(tier_idx)
            if tier is not None:
                tier.drop_stripes([bare for _, bare in items])

    def used_bytes(self) -> int:
        return sum(t.used_bytes() for t in self.tiers if t is not None)

    def clear(self) -> None:
        for t in self.tiers:
            if t is not None:
                t.clear()

    def ping(self) -> None:
        for t in self.tiers:
            if t is not None:
                t.ping()

    def close(self) -> None:
        self._far.shutdown(wait=False)
        for t in self.tiers:
            if t is not None:
                t.close()
