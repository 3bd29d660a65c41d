"""The reads of one load job from its tier's shards, and what they found.

Each read is one batched ranged read of one shard (:meth:`ShardReads.read`), on the job's reader thread or on one
of the shard readers; it never raises. What it finds is kept per ``(shard, stripe id)``: stripes that are gone or
whose values disagree with their tickets (:attr:`ShardReads.missing`: their tickets lie and are dropped) and stripes
whose read failed (:attr:`ShardReads.errored`: transient, their tickets are kept). After a shard fails, the job reads
nothing more from it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from range_connector.backends.base import Backend, RangeRead
from range_connector.backends.tiered import stripe_tier
from range_connector.errors import BackendError
from range_connector.worker.counters import Counters

#: threads that read the farther tiers of a mixed shard read (shared by every job; a read holds one while it runs)
_TIER_READERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="range-tier-read")

logger = logging.getLogger("vllm.range_connector.worker.loads")


class ShardReads:
    """Reads of one job, and their outcome per stripe.

    Args:
        backends: ``[num_shards]`` the worker's backends.
        stats: the worker's counters (``load_integrity_errors``, ``load_backend_errors``).

    Attributes:
        missing: ``(shard_idx, stripe_id)`` of stripes that are gone (their tickets lie: dropped).
        errored: ``(shard_idx, stripe_id)`` of stripes whose read failed (transient: tickets kept).
        failed_shards: shards whose read raised a tier error (not asked again by this job).
        lock: guards ``missing`` and ``errored`` (reads run on several threads).
        device: the reads' destinations are device memory (``Backend.read_ranges_device``: a device bank).
    """

    def __init__(self, backends: Sequence[Backend], stats: Counters) -> None:
        self.backends = backends
        self.stats = stats
        self.missing: set[tuple[int, str]] = set()
        self.errored: set[tuple[int, str]] = set()
        self.failed_shards: set[tuple[int, int]] = set()  # (shard, tier)
        self.lock = threading.Lock()
        self.device = False

    def read(self, s: int, reads: list[RangeRead], *, cancelled: threading.Event, deadline: float) -> None:
        """One batched ranged read of shard ``s`` into the reads' destinations (in a tier hierarchy one per tier
        the reads' stripes are on, so that a failing far tier fails only its own reads); failures are recorded,
        never raised. Nothing is read once the job is ``cancelled``, past its ``deadline`` (``time.monotonic()``),
        or from a shard (of a tier) that failed."""
        by_tier: dict[int, list[RangeRead]] = {}
        for r in reads:
            by_tier.setdefault(stripe_tier(r.stripe_id)[0], []).append(r)
        if len(by_tier) == 1:
            [(tier, tier_reads)] = by_tier.items()
            self._read(s, tier, tier_reads, cancelled=cancelled, deadline=deadline)
            return
        # Several tiers: their reads run side by side (the nearest here, the others on the tier-read threads), so a
        # mixed hit takes about as long as its slowest run rather than the sum.
        items = sorted(by_tier.items())
        others = [_TIER_READERS.submit(self._read, s, tier, tier_reads, cancelled=cancelled, deadline=deadline)
                  for tier, tier_reads in items[1:]]
        self._read(s, items[0][0], items[0][1], cancelled=cancelled, deadline=deadline)
        for fut in others:
            fut.result()  # (_read records its failures and never raises)

    def _read(self, s: int, tier: int, reads: list[RangeRead], *, cancelled: threading.Event,
              deadline: float) -> None:
        if cancelled.is_set() or (s, tier) in self.failed_shards or time.monotonic() > deadline:
            with self.lock:
                self.errored.update((s, r.stripe_id) for r in reads)
            return
        try:
            ok = self._reader(s)(reads)
            with self.lock:
                self.missing.update((s, r.stripe_id) for r, good in zip(reads, ok) if not good)
        except ValueError as exc:  # a stored value disagrees with its ticket: find which, stripe by stripe
            logger.warning("Range load from shard %d: %s", s, exc)
            self.stats.add("load_integrity_errors")
            self._reread_each_stripe(s, reads)
        except BackendError as exc:
            if not cancelled.is_set():  # (a cancelled direct receive ends with its gate's refusal)
                logger.warning("Range load from shard %d: %s", s, exc)
                self.stats.add("load_backend_errors")
            self.failed_shards.add((s, tier))
            with self.lock:
                self.errored.update((s, r.stripe_id) for r in reads)

    def _reader(self, s: int):
        """Shard ``s``'s batched ranged read into the reads' kind of memory."""
        return self.backends[s].read_ranges_device if self.device else self.backends[s].read_ranges

    def _reread_each_stripe(self, s: int, reads: list[RangeRead]) -> None:
        """After a shard's batched read was refused as inconsistent, read stripe by stripe (only on this error
        path) so that only the stripes whose values disagree with their tickets are treated as gone."""
        by_stripe: dict[str, list[RangeRead]] = defaultdict(list)
        for r in reads:
            by_stripe[r.stripe_id].append(r)
        for stripe_id, stripe_reads in by_stripe.items():
            try:
                target = None if all(self._reader(s)(stripe_reads)) else self.missing
            except ValueError:
                target = self.missing
            except BackendError:
                target = self.errored
            if target is not None:
                with self.lock:
                    target.add((s, stripe_id))
