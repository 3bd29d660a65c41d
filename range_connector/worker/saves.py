"""Saves (worker side): a step's new full chunks become, per shard, stripes written with one write each, and their
tickets are published with them.

The chunks are gathered out of the KV cache in the step (vLLM may reuse the blocks afterwards), from blocks the step
owns, so preemption and block reuse cannot mix foreign KV into a stripe. With ``save_mode`` ``"sync"`` they are
written before :meth:`StripeSaver.save` returns; with ``"async"`` one background thread writes them (at most
``save_backlog_bytes`` gathered and unwritten; past it the save is skipped, but an empty backlog takes any one step's
save, so that a step larger than the bound is still saved), except a save with a chunk somebody waits for (a
hand-off's), written in the step. A failed or skipped write is counted,
never raised: a lost save is only a future miss. After a shard's write fails, saves to it are skipped for the tier's
``retry_s``. Each stripe write that returned is timed, by tier (histogram ``save_seconds``,
:mod:`range_connector.histograms`).

A save can also be asked to *confirm* its chunks (a disaggregated producer's, whose announcement must name only KV
that is stored): each such chunk is reported once its write ended, stored or not (:meth:`StripeSaver.take_results`),
including the chunks of a save that was skipped or failed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
import xxhash

from range_connector.backends.base import Backend, StripeWrite
from range_connector.backends.tiered import TieredBackend, leaf_backends
from range_connector.config import RangeConfig
from range_connector.errors import BackendError
from range_connector.histograms import observe
from range_connector.kv.heads import HeadSlice
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.sharding import ShardPlan
from range_connector.kv.stripes import (
    chunk_checksum,
    chunk_groups,
    gather_layer,
    new_stripe_id,
)
from range_connector.kv.tickets import Ticket, head_keys
from range_connector.worker.context import LoadContext
from range_connector.worker.counters import Counters

logger = logging.getLogger("vllm." + __name__)


def follow_tier_reset(backends: Sequence[Backend]) -> None:
    """After the scheduler reset the connector's cache: clear the in-process tiers behind ``backends`` (the
    scheduler cleared the shared ones, whose saves from now on carry the new epoch). Never raises."""
    for backend in leaf_backends(backends):
        if backend.is_shared:
            backend.refresh_epoch()
            continue
        try:
            backend.clear()
        except (BackendError, NotImplementedError) as exc:
            logger.warning("Range reset: %s not cleared: %s", backend.name, exc)

#: one chunk to save: its hash and the engine block ids of the whole chunk
SaveChunk = tuple[ChunkHash, tuple[int, ...]]
#: who waits for a chunk's outcome: ``(req_id, chunk_idx)``, or ``None`` when nobody does
SaveOwner = tuple[str, int] | None


class StripeSaver:
    """Writes a worker's saves, synchronously or on its saver thread.

    Args:
        config: resolved config (``save_mode``, ``save_backlog_bytes``, the tier's ``retry_s``).
        plan: the shard plan of the worker's chunks.
        backends: ``[num_shards]`` the worker's backends.
        shard_idxs: the global shard index of each backend (part of every ticket key).
        stats: the worker's counters (``saved_*``, ``save_errors``, ``saves_skipped*`` are counted here).
        head_slice: the KV heads the rank's cache holds: its tickets cover them, one key per head.
        ticket_group: the rank's ticket group, reported with each saved chunk.
    """

    def __init__(self, config: RangeConfig, plan: ShardPlan, backends: Sequence[Backend], shard_idxs: tuple[int, ...],
                 stats: Counters, *, head_slice: HeadSlice = HeadSlice(0, 1),
                 ticket_group: int = 0) -> None:
        self.config = config
        self.plan = plan
        self.backends = backends
        self.shard_idxs = shard_idxs
        self.head_slice = head_slice
        self.ticket_group = ticket_group
        self.stats = stats
        self._down_until = [0.0] * len(backends)  # per shard: monotonic time before which saves are skipped
        self._saved: list[tuple[ChunkHash, int, tuple[Ticket, ...]]] = []  # (appended by the saver thread too)
        self._results: list[tuple[str, int, bool]] = []  # confirmed chunks' outcomes (likewise)
        #: with save_mode "async": chunks whose write ended without storing them (likewise), so that the scheduler
        #: stops waiting for them (:mod:`range_connector.scheduler.saves_in_flight`)
        self._unsaved: list[ChunkHash] = []
        self._reports_unsaved = config.save_mode == "async"
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-save")
        self._pending: weakref.WeakSet[Future] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._backlog_bytes = 0
        #: resets seen (:meth:`reset`): a save gathered in an earlier generation is not written, nor reported
        self.generation = 0
        for b in backends:  # a hierarchy times each tier's write where it runs (far tiers: in the background)
            if isinstance(b, TieredBackend):
                b.write_observer = self._observe_write

    def _observe_write(self, tier_idx: int, seconds: float) -> None:
        if tier_idx < len(self.config.tiers):
            observe(self.stats, "save_seconds", self.config.tiers[tier_idx].type, seconds)

    @property
    def backlog_bytes(self) -> int:
        """Bytes gathered and not yet written (``save_mode`` ``"async"``)."""
        return self._backlog_bytes

    def has_saved(self) -> bool:
        """Whether saves completed since :meth:`take_saved` last ran, or outcomes wait in :meth:`take_results` or
        :meth:`take_unsaved`."""
        return bool(self._saved or self._results or self._unsaved)

    def take_saved(self) -> list[tuple[ChunkHash, int, tuple[Ticket, ...]]]:
        """``(chunk hash, ticket group, [num_shards] tickets)`` of the chunks whose every shard was written since
        the last call."""
        with self._lock:
            saved, self._saved = self._saved, []
        return saved

    def take_unsaved(self) -> list[ChunkHash]:
        """With ``save_mode`` ``"async"``: the chunks whose save by this worker ended since the last call without
        storing them on every shard (skipped, dropped or failed); always empty with ``"sync"``."""
        with self._lock:
            unsaved, self._unsaved = self._unsaved, []
        return unsaved

    def take_results(self) -> list[tuple[str, int, bool]]:
        """``(req_id, chunk_idx, stored)`` of every confirmed chunk whose write ended since the last call (``stored``:
        every shard of this worker holds it)."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def reset(self, generation: int) -> None:
        """The connector's cache was reset (``generation``: resets so far): saves gathered before are not written,
        and completed saves not yet taken (:meth:`take_saved`) are forgotten (their tier was cleared)."""
        with self._lock:
            self.generation = generation
            self._saved = []

    def report(self, owners: Sequence[SaveOwner], stored: bool, chunk_hashes: Sequence[ChunkHash] = ()) -> None:
        """Record the outcome of owned chunks that are not handed to :meth:`save` (dropped before it), for
        :meth:`take_results`; ``chunk_hashes`` (those chunks', owned or not) are reported unsaved when not
        ``stored`` (:meth:`take_unsaved`)."""
        results = [(o[0], o[1], stored) for o in owners if o is not None]
        unsaved = list(chunk_hashes) if self._reports_unsaved and not stored else []
        if results or unsaved:
            with self._lock:
                self._results.extend(results)
                self._unsaved.extend(unsaved)

    def save(self, chunks: list[SaveChunk], context: LoadContext, owners: Sequence[SaveOwner] = (),
             tiers: tuple[int, ...] | None = None) -> None:
        """Gather ``chunks`` out of the KV cache (``context``: its rows and layout) and write them as one stripe per
        shard (split at the tier's value limit).

        Args:
            owners: ``[len(chunks)]`` who waits for each chunk's outcome (``(req_id, chunk_idx)``), or empty: the
                outcome of each owned chunk is reported through :meth:`take_results` once its write ended, or at
                once when the save is skipped. A save with an owned chunk is written before this returns, whatever
                ``save_mode``.
            tiers: in a tier hierarchy, the tiers to write (``None``: all; ``StripeWrite.tiers``).
        """
        owners = list(owners) or [None] * len(chunks)
        if len(owners) != len(chunks):  # (a caller's bug: report nothing rather than mismatched outcomes)
            logger.error("Range save: %d owners for %d chunks; their outcomes are not reported", len(owners),
                         len(chunks))
            owners = [None] * len(chunks)
        layout = context.layout
        bps = self.plan.blocks_per_shard
        stripes = []  # (shard, backend, chunks of the stripe, per-layer values, the tier's reset epoch now)
        for s, backend in enumerate(self.backends):
            if time.monotonic() < self._down_until[s]:
                self.stats.add("saves_skipped")
                continue
            try:
                groups = chunk_groups(len(chunks), bps, layout.num_planes * layout.row_bytes,
                                      backend.max_value_bytes)
            except ValueError as exc:
                logger.warning("Range save to shard %d: %s", s, exc)
                self.stats.add("save_errors")
                continue
            for group in groups:
                stripe_chunks = [chunks[i] for i in group]
                stripes.append((s, backend, stripe_chunks, self._gather_stripe(s, stripe_chunks, context),
                                backend.epoch_hint, tiers))
        hashes = [h for h, _ in chunks]
        if self.config.save_mode != "async" or any(o is not None for o in owners):
            # (a save that somebody waits for, a hand-off's, is written in the step even with "async": its request's
            # announcement, serialized as the request ends, names only what is stored by then)
            self._write_stripes(stripes, hashes, owners, 0, context, self.generation)
            return
        nbytes = sum(v.numel() * v.element_size() for *_rest, values, _epoch, _tiers in stripes for v in values)
        with self._lock:
            if self._backlog_bytes and self._backlog_bytes + nbytes > self.config.save_backlog_bytes:
                self.stats.add("saves_skipped_backlog")
                self._results.extend((o[0], o[1], False) for o in owners if o is not None)
                self._unsaved.extend(hashes)
                return
            self._backlog_bytes += nbytes
        self._pending.add(self._thread.submit(self._write_stripes, stripes, hashes, owners, nbytes, context,
                                              self.generation))

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the background writes of ``save_mode`` ``"async"``; whether all ended."""
        pending = [f for f in self._pending if not f.done()]
        return not wait(pending, timeout=timeout_s).not_done if pending else True

    def close(self) -> None:
        """Stop the saver thread (after :meth:`wait`)."""
        self._thread.shutdown(wait=False)

    def _gather_stripe(self, s: int, chunks: list[SaveChunk], context: LoadContext) -> list[torch.Tensor]:
        """Copy shard ``s``'s blocks of ``chunks`` out of the KV cache: per layer ``[num_planes, stripe_blocks,
        row]`` host tensors that the stripe's values are written from."""
        rows, layout = context.rows, context.layout
        positions = list(self.plan.shard_blocks(s))
        index = torch.tensor([ids[p] for _, ids in chunks for p in positions], dtype=torch.long)
        num_layers = len(context.layer_names)
        if rows[0].is_cuda:  # gather on the device, one device-to-host copy per layer
            index = index.to(rows[0].device)
            return [gather_layer(rows, layout, layer_idx, index).cpu() for layer_idx in range(num_layers)]
        return [gather_layer(rows, layout, layer_idx, index) for layer_idx in range(num_layers)]

    def _write_stripes(self, stripes: list, hashes: list[ChunkHash], owners: Sequence[SaveOwner], backlog_bytes: int,
                       context: LoadContext, generation: int) -> None:
        """Write gathered stripes (of reset ``generation``: none once a reset came since); chunks whose every shard
        was written are reported saved, and every owned chunk's outcome (stored or not) is kept for
        :meth:`take_results`."""
        reported = False
        try:
            tickets_by_chunk: dict[ChunkHash, list[Ticket | None]] = {h: [None] * self.plan.num_shards for h in hashes}
            for s, backend, stripe_chunks, values, epoch, tiers in stripes:
                if self.generation != generation:
                    self.stats.add("saves_skipped_reset")
                    break
                self._write_stripe(s, backend, stripe_chunks, values, tickets_by_chunk, context, epoch, tiers)
            saved = [(h, self.ticket_group, tuple(tickets)) for h, tickets in tickets_by_chunk.items()
                     if all(t is not None for t in tickets)]
            with self._lock:
                if self.generation != generation:  # (a reset while it was written: the in-process tier is cleared)
                    saved = []
                stored = {h for h, _group, _tickets in saved}
                self._saved.extend(saved)  # type: ignore[arg-type]
                self._results.extend((o[0], o[1], h in stored) for h, o in zip(hashes, owners) if o is not None)
                if self._reports_unsaved:
                    self._unsaved.extend(h for h in hashes if h not in stored)
                self._backlog_bytes -= backlog_bytes
                reported = True
            self.stats.add("saved_chunks", len(saved))
        except Exception:  # a background write must never take the worker down
            logger.exception("Range save failed")
            self.stats.add("save_errors")
            if not reported:
                with self._lock:
                    self._results.extend((o[0], o[1], False) for o in owners if o is not None)
                    if self._reports_unsaved:
                        self._unsaved.extend(hashes)
                    self._backlog_bytes -= backlog_bytes

    def _write_stripe(self, s: int, backend: Backend, chunks: list[SaveChunk], values: list[torch.Tensor],
                      tickets_by_chunk: dict[ChunkHash, list[Ticket | None]], context: LoadContext,
                      epoch: int | None = None, tiers: tuple[int, ...] | None = None) -> None:
        layout = context.layout
        bps = self.plan.blocks_per_shard
        stripe_blocks = len(chunks) * bps
        views = [memoryview(v.view(torch.uint8).numpy()).cast("B") for v in values]
        stripe_id = new_stripe_id()
        stripe_sums = tuple(xxhash.xxh3_64_intdigest(v) for v in views)
        tickets = []
        for c, (chunk_hash, _) in enumerate(chunks):
            sums = tuple(chunk_checksum(v, layout.num_planes, stripe_blocks, c * bps, bps, layout.row_bytes)
                         for v in views)
            t = Ticket(stripe_id, c * bps, bps, stripe_blocks, len(context.layer_names), layout.num_planes,
                       layout.row_bytes, sums, stripe_sums, self.head_slice.start, self.head_slice.count)
            tickets.append((chunk_hash, t))
        shard_idx = self.shard_idxs[s]
        write = StripeWrite(stripe_id, views, [(key, t.encode()) for h, t in tickets
                                               for key in head_keys(h, shard_idx, self.head_slice.heads)],
                            epoch=epoch, tiers=tiers)  # (gathered before a reset of a shared tier: it stores nothing)
        # (read around the call: a skip by another thread saving through the same backend object at that moment
        # could swap which of the two skip counters is added to, never lose one)
        no_space = backend.counters.saves_skipped_no_space
        try:
            start_s = time.monotonic()
            stored = backend.write_stripe(write)
            if not isinstance(backend, TieredBackend):  # (a hierarchy reports each tier's write itself)
                self._observe_write(0, time.monotonic() - start_s)
        except (BackendError, ValueError) as exc:
            logger.warning("Range save to shard %d failed: %s", s, exc)
            self.stats.add("save_errors")
            if isinstance(exc, BackendError):
                self._down_until[s] = time.monotonic() + self.config.tier.retry_s
            return
        if not stored:  # no room within the budget or on the tier's storage (or the tier was reset since)
            full = backend.counters.saves_skipped_no_space > no_space
            self.stats.add("saves_skipped_no_space" if full else "saves_skipped_capacity")
            return
        self.stats.add("saved_bytes", write.nbytes)
        self.stats.add("saved_stripes")
        for h, t in tickets:
            tickets_by_chunk[h][s] = t
