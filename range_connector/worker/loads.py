"""One batch of loads, delivered into the KV cache layer group by layer group (worker side).

A :class:`LoadJob` covers the chunks of one or more requests that are loaded together. :meth:`LoadJob.start`
plans the reads (one segment per (shard, stripe)) and either borrows read-only views of the stored stripes (a tier
that can lend them: the in-process DRAM tier), or queues one read per layer group on the transfer banks' reader
thread (:mod:`range_connector.worker.banks`): into a bank, or, when the KV cache is in host memory and the tier can
scatter, straight into the destination blocks (:mod:`range_connector.worker.direct_receive`).
:meth:`LoadJob.deliver_through` then delivers the groups up to a layer, in order: it waits for the group's read (bounded
by the job's deadline: see :attr:`LoadJob.deadline` for what it bounds), verifies the chunks against their checksums and, from a bank, copies them into the destination
blocks with one batched index copy per (layer, plane). Who calls it decides the load mode (docs/architecture.md, "The
path of one request"):

* *layer-pipelined*: the forward's ``wait_for_layer_load(layer)`` delivers up to that layer only, so attention of
  layer ``l`` waits for layer ``l`` while later layers are still being read;
* *asynchronous*: a background thread delivers every layer while the engine runs other requests;
* *synchronous* (for comparison only): everything is delivered inside ``start_load_kv``.

Every write into the KV cache happens while the job is open: copies under :attr:`LoadJob.lock`, direct receives
inside the job's gate (entered around each non-blocking socket receive); :meth:`cancel` closes both and waits for
a write in progress, so a job whose request was aborted, or whose deadline passed, never writes into blocks it no
longer owns. A chunk that is missing on any shard, or fails its checksum in any layer, fails from there on (and the
later chunks of its request too); its blocks are reported to vLLM, which recomputes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from range_connector.backends.base import RangeRead
from range_connector.config import LOAD_MODES
from range_connector.errors import BackendTimeoutError
from range_connector.kv.metadata import ChunkTransfer, RequestTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.stripes import plan_segments
from range_connector.kv.tickets import Ticket
from range_connector.worker.device_reads import checked_bytes, device_bank_reads
from range_connector.worker.direct_receive import DirectRows, WriteGate
from range_connector.worker.lent_views import LentViews, row_selector
from range_connector.worker.shard_reads import ShardReads
from range_connector.worker.verify import bank_sums, verify_group

if TYPE_CHECKING:
    from range_connector.worker.context import LoadContext

logger = logging.getLogger("vllm." + __name__)

_NEVER = 1 << 62
#: longest single wait of a thread whose deadline may move (a layer-pipelined load's: see LoadJob.deadline)
_WAIT_SLICE_S = 0.05

#: the rows a load stages per (layer, plane), gaps included, are at most this many times the registered KV pool's
#: blocks (a legitimate load writes at most one pool's blocks; the rest allows for gaps inside stripes)
MAX_STAGED_POOLS = 2

#: load modes (``RequestTransfer.mode``, config key ``load_mode``)
PIPELINED, ASYNC, SYNC = LOAD_MODES[:3]  # ("auto" is the scheduler's: it picks one of these)


class LoadJob:
    """Loads of one or more requests, delivered layer group by layer group.

    Args:
        context: what the job may use of its worker: KV rows, backends, banks, threads and counters.
        reqs: the requests' load plans (from the scheduler's metadata).
        deadline: ``time.monotonic()`` after which nothing more is waited for (those chunks fail), as the job
            starts (see :attr:`deadline`).
        mode: ``"pipelined"``, ``"async"`` or ``"sync"`` (who delivers: see the module docstring).

    Attributes:
        failed_from: ``req_id -> chunk_idx``: the request's load fails from that chunk on.
        layer_ready_s: per layer, ``time.monotonic()`` when its bytes were in reach (bank filled or view lent).
        layer_delivered_s: per layer, when its blocks were copied into the KV cache (or given up).
        layer_waited_s: per layer, when attention asked for it (``wait_for_layer_load``), if it did.
    """

    def __init__(self, context: LoadContext, reqs: list[RequestTransfer], deadline: float, mode: str) -> None:
        layout = context.layout
        self.w = context
        self.reqs = reqs
        self._deadline_at_start_s = deadline
        #: a layer-pipelined job: seconds the forward computed between two deliveries, and since when it has been
        #: computing (``None``: it is waiting in :meth:`deliver_through`, or the job is not pipelined)
        self._computed_s = 0.0
        self._computing_since_s: float | None = None
        self.mode = mode
        self.lock = threading.Lock()
        self.closed = False
        self.finished = False
        #: the load ran out of its deadline (or found no bank in time) before every layer was in reach
        self.deadline_missed = False
        self.started_s = time.monotonic()
        self.failed_from: dict[str, int] = {}
        self._fail_lock = threading.Lock()  # failures come from the delivering thread and from the step thread
        self.num_layers = len(context.layer_names)
        self.num_planes, self.row_bytes = layout.num_planes, layout.row_bytes
        self.layer_ready_s: list[float | None] = [None] * self.num_layers
        self.layer_delivered_s: list[float | None] = [None] * self.num_layers
        self.layer_waited_s: list[float | None] = [None] * self.num_layers
        self.events: list[object] = []  # CUDA events of this job's copies
        self._next_group = 0
        self._cancelled = threading.Event()
        #: the reads from the tier's shards, and what they found (stripes gone, reads failed)
        self.reads = ShardReads(context.backends, context.stats)
        self._banks: list = []
        self._pool = context.banks  # (the banks' pool: host banks, or device banks for GPUDirect reads)
        #: direct receive (CPU): where each row lands, and one read per layer group on the reader thread
        self.direct: DirectRows | None = None
        self._fills: list[Future] = []
        self._gate = WriteGate()
        #: a tier that lends its stripes in process (the DRAM tier): the lent views, else None
        self.lent: LentViews | None = None
        self._delivered: list[threading.Event] = []  # direct receive: per layer group, delivered (or cancelled)
        self.done: list[tuple[ChunkHash, list[int], list[int]]] = []  # filled by finish()

    @property
    def deadline_at_start_s(self) -> float:
        """``time.monotonic()`` the job was given as its deadline when it started (:attr:`deadline` moves on from it
        while the forward of a layer-pipelined job computes)."""
        return self._deadline_at_start_s

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` after which nothing more is waited for (those chunks fail).

        It bounds the time spent waiting for the tier, not the compute that paces a layer-pipelined load: while the
        forward computes between two deliveries, the deadline moves on with the clock (the reads wait for banks
        that attention frees, and views need no waiting at all). Without that, a hit whose own forward takes
        longer than the load's deadline (a 4,096-token prefix under a 32-layer model on a CPU: 1.3 s against a
        0.25 s deadline) was cut after its first layers and recomputed in full, although every byte was in reach.
        Asynchronous and synchronous jobs wait from start to end: theirs stays where it started.
        """
        since = self._computing_since_s
        return self._deadline_at_start_s + self._computed_s + (0.0 if since is None else time.monotonic() - since)

    def _wait_paced(self, wait) -> bool:
        """``wait(timeout_s) -> bool`` in slices until it returns true, the (moving) deadline passes or the job is
        cancelled; whether it returned true."""
        while True:
            remaining_s = self.deadline - time.monotonic()
            if wait(min(max(0.0, remaining_s), _WAIT_SLICE_S)):
                return True
            if remaining_s <= _WAIT_SLICE_S or self._cancelled.is_set():
                return False

    # ------------------------------------------------------------------ set-up
    def _fail(self, req_id: str, chunk_idx: int) -> None:
        with self._fail_lock:  # (a read, a min and a write: two threads must not interleave them)
            self.failed_from[req_id] = min(self.failed_from.get(req_id, chunk_idx), chunk_idx)

    def fail_all(self) -> None:
        """Every request of the job fails from its first chunk (safe while another thread still delivers)."""
        for req in self.reqs:
            if req.chunks:
                self._fail(req.req_id, req.chunks[0].chunk_idx)

    def _alive(self, req: RequestTransfer, chunk: ChunkTransfer) -> bool:
        return chunk.chunk_idx < self.failed_from.get(req.req_id, _NEVER)

    def start(self) -> None:
        """Plan the reads and put them in flight (views borrowed, or bank fills queued). Never raises for a tier
        failure: the affected chunks fail."""
        w = self.w
        wanted: dict[tuple[int, str], list[Ticket]] = defaultdict(list)
        seen: set[tuple[int, str, int, int]] = set()  # (shard, stripe, first block, blocks): work per chunk stays O(1)
        for req in self.reqs:
            if req.fail or not req.chunks:
                if req.chunks:
                    self._fail(req.req_id, req.chunks[0].chunk_idx)
                continue
            for chunk in req.chunks:
                for s, t in enumerate(chunk.tickets):
                    if not w.ticket_fits(t):
                        self._fail(req.req_id, chunk.chunk_idx)
                    elif (key := (s, t.stripe_id, t.block_offset, t.num_blocks)) not in seen:
                        seen.add(key)
                        wanted[(s, t.stripe_id)].append(t)
        # Staging is sized from the tickets' geometry (a segment spans its wanted chunks and the gaps between them):
        # the rows one load stages per (layer, plane) stay within MAX_STAGED_POOLS registered KV pools, so that
        # tickets that are each within bounds cannot add up to gigabytes either. Stripes past it are not read.
        budget_rows = MAX_STAGED_POOLS * w.layout.num_blocks
        refused: set[tuple[int, str]] = set()
        for key, tickets in list(wanted.items()):
            span = max(t.block_offset + t.num_blocks for t in tickets) - min(t.block_offset for t in tickets)
            if span > budget_rows:
                refused.add(key)
                del wanted[key]
            else:
                budget_rows -= span
        if refused:
            logger.warning("Range load: %d stripe(s) would stage more rows than %d KV pools; their chunks are "
                           "recomputed", len(refused), MAX_STAGED_POOLS)
            w.stats.add("load_geometry_refused", len(refused))
            for req in self.reqs:
                for chunk in req.chunks:
                    if any((s, t.stripe_id) in refused for s, t in enumerate(chunk.tickets)):
                        self._fail(req.req_id, chunk.chunk_idx)
        self.segments = plan_segments(wanted)
        self._seg_of = {(seg.shard_idx, seg.ticket.stripe_id): seg for seg in self.segments}
        self.views = bool(self.segments) and all(
            w.backends[seg.shard_idx].serves_views(seg.ticket.stripe_id) for seg in self.segments)
        if self.views:
            self.groups = [range(layer, layer + 1) for layer in range(self.num_layers)]
            self.lent = LentViews(self)
            self.lent.start()
        else:
            self._start_banked()
        if self.mode == PIPELINED:  # the forward computes until attention asks for its first layer
            self._computing_since_s = time.monotonic()

    def _read_shard(self, s: int, reads: list[RangeRead]) -> None:
        """One batched ranged read of one shard (into a bank, or straight into the KV cache)."""
        self.reads.read(s, reads, cancelled=self._cancelled, deadline=self.deadline)

    def _chunk_present(self, req: RequestTransfer, chunk: ChunkTransfer) -> bool:
        """False (and the chunk fails) if a shard's stripe is gone (its ticket is dropped) or unreadable."""
        with self.reads.lock:
            gone, broken = set(self.reads.missing), set(self.reads.errored)
        lost = [s for s, t in enumerate(chunk.tickets) if (s, t.stripe_id) in gone]
        for s in lost:  # a ticket whose stripe is gone is not offered again
            self.w.drop(chunk.chunk_hash, s)
        if lost or any((s, t.stripe_id) in broken for s, t in enumerate(chunk.tickets)):
            self._fail(req.req_id, chunk.chunk_idx)
            return False
        return True

    def _start_banked(self) -> None:
        """Queue one read per layer group, into a bank or straight into the KV cache (direct receive): each is one
        batched ranged read per shard."""
        w = self.w
        num_planes, row_bytes = self.num_planes, self.row_bytes
        self.rows_per_region = sum(seg.num_blocks for seg in self.segments)
        self.region_bytes = self.rows_per_region * row_bytes
        layer_bytes = num_planes * self.region_bytes
        per_bank = max(1, w.config.bank_bytes // max(1, layer_bytes))
        self.groups = [range(g, min(self.num_layers, g + per_bank)) for g in range(0, self.num_layers, per_bank)]
        self._plan = []  # (req, chunk, [(shard, ticket, segment)], src_rows, dst_ids)
        for req in self.reqs:
            for chunk in req.chunks:
                parts = [(s, t, self._seg_of.get((s, t.stripe_id))) for s, t in enumerate(chunk.tickets)]
                src_rows, dst_ids = [], []
                for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                    s, slot = w.plan.shard_of_block(pos)
                    seg = parts[s][2]
                    if seg is not None:
                        src_rows.append(seg.bank_row + parts[s][1].block_offset - seg.first_block + slot)
                        dst_ids.append(block_id)
                if any(seg is None for _, _, seg in parts):
                    self._fail(req.req_id, chunk.chunk_idx)
                self._plan.append((req, chunk, parts, src_rows, dst_ids))
        if not self.segments:
            return
        if w.device.can_receive_direct and all(
                w.backends[seg.shard_idx].serves_scatter(seg.ticket.stripe_id) for seg in self.segments):
            self.direct = DirectRows.plan(w.kv_rows, self.num_layers, num_planes, row_bytes, self.segments,
                                          self.rows_per_region, [(e[3], e[4]) for e in self._plan],
                                          {b for req in self.reqs for b in req.computed_block_ids})
        if self.direct is not None:
            # Read-ahead stays bounded as on the bank path (num_banks layer groups beyond the last one delivered),
            # so a layer-pipelined load keeps handing early layers to attention while later ones are still read.
            self._delivered = [threading.Event() for _ in self.groups]
            self._fills = [w.reader.submit_task(self._fill_for(g)) for g in self.groups]
            return
        # GPUDirect reads into device banks where every stripe's tier takes them (worker/device_reads.py)
        self.reads.device = w.device_banks is not None and all(
            w.backends[seg.shard_idx].serves_device_reads(seg.ticket.stripe_id) for seg in self.segments)
        self._pool = w.device_banks if self.reads.device else w.banks
        self._banks = [w.reader.submit(self._pool, len(g) * layer_bytes, self._fill_for(g), self._wait_paced)
                       for g in self.groups]

    def _fill_for(self, group: range):
        w = self.w
        num_planes, row_bytes, region_bytes = self.num_planes, self.row_bytes, self.region_bytes

        def fill(buffer: torch.Tensor | None = None) -> None:
            if self._cancelled.is_set():
                return
            if buffer is None:
                assert self.direct is not None
                behind = self.groups.index(group) - w.config.num_banks
                if behind >= 0 and not self._wait_paced(self._delivered[behind].wait):
                    raise BackendTimeoutError("the load deadline passed before earlier layer groups were delivered")
                if self._cancelled.is_set():
                    return
                by_shard = self.direct.reads(group, self._gate, w.config.verify_checksums)
            else:
                by_shard = device_bank_reads(self, group, buffer) if self.reads.device else bank_reads(buffer)
            if len(by_shard) > 1:  # shards live on different servers: read them at the same time
                for fut in [w.shard_readers.submit(self._read_shard, s, reads) for s, reads in by_shard.items()]:
                    fut.result()
            else:
                for s, reads in by_shard.items():
                    self._read_shard(s, reads)
            host = checked_bytes(self, buffer) if self.reads.device else None  # (the host copy it is checked on)
            now = time.monotonic()
            for layer_idx in group:
                self.layer_ready_s[layer_idx] = now
            return host

        def bank_reads(buffer: torch.Tensor) -> dict[int, list[RangeRead]]:
            mv = memoryview(buffer.numpy()).cast("B")
            by_shard: dict[int, list[RangeRead]] = defaultdict(list)
            for seg in self.segments:
                t = seg.ticket
                for layer_idx in group:
                    for p in range(num_planes):
                        start = ((layer_idx - group.start) * num_planes + p) * region_bytes + seg.bank_row * row_bytes
                        length = seg.num_blocks * row_bytes
                        by_shard[seg.shard_idx].append(RangeRead(
                            t.stripe_id, layer_idx, (p * t.stripe_blocks + seg.first_block) * row_bytes, length,
                            t.layer_bytes, mv[start:start + length]))
            return by_shard
        return fill

    # ------------------------------------------------------------------ delivery
    def group_of(self, layer_idx: int) -> int:
        """Index of the layer group that holds ``layer_idx``."""
        for g, group in enumerate(self.groups):
            if layer_idx in group:
                return g
        raise IndexError(layer_idx)

    def deliver_through(self, layer_idx: int) -> None:
        """Deliver every layer group up to the one holding ``layer_idx`` (in order), waiting at most until the
        deadline. Thread: whoever drives this job (only one at a time)."""
        last = self.group_of(min(layer_idx, self.num_layers - 1))
        since = self._computing_since_s
        if since is not None:  # the forward computed until now: that time is not the tier's (see deadline)
            self._computed_s += time.monotonic() - since
            self._computing_since_s = None
        try:
            while self._next_group <= last:
                g = self._next_group
                self._next_group += 1
                if self.lent is not None:
                    self.lent.deliver(g)
                elif self.direct is not None:
                    self._deliver_direct_group(g)
                else:
                    self._deliver_bank_group(g)
                now = time.monotonic()
                for layer in self.groups[g]:
                    self.layer_delivered_s[layer] = now
                if self._delivered:
                    self._delivered[g].set()
        finally:
            if self.mode == PIPELINED and not self.closed and self._next_group < len(self.groups):
                self._computing_since_s = time.monotonic()

    def _give_up(self, g: int, why: str) -> None:
        """Layers from group ``g`` on will not be delivered: every chunk of the job fails."""
        logger.warning("Range load: layers %d-%d not delivered (%s)", self.groups[g].start,
                       self.groups[-1].stop - 1, why)
        self.w.stats.add("load_deadline_misses")
        self.deadline_missed = True
        self.cancel()
        self.fail_all()

    def _deliver_bank_group(self, g: int) -> None:
        w = self.w
        group = self.groups[g]
        if not self._banks or self.closed:
            return
        bank = self._banks[g]
        try:
            bank.done.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except Exception as exc:  # deadline, no free bank, or a failed fill: nothing more can be trusted
            self._abandon(bank)
            self._give_up(g, str(exc) or type(exc).__name__)
            return
        try:
            buf = bank.buffer
            for req, chunk, _parts, _src, _dst in self._plan:
                if self._alive(req, chunk):
                    self._chunk_present(req, chunk)
            if w.config.verify_checksums:
                checked = buf if bank.host is None else bank.host  # (a device bank: its copy brought back)
                if self.reads.device and bank.host is None:  # (a fill a cancel cut short: nothing to check or copy)
                    return
                verify_group(self, group, lambda grp, row, n: bank_sums(checked, grp, row, n, self.num_planes,
                                                                         self.region_bytes, self.row_bytes))
            src_rows, dst_ids = [], []
            for req, chunk, _parts, c_src, c_dst in self._plan:
                if self._alive(req, chunk):
                    src_rows.extend(c_src)
                    dst_ids.extend(c_dst)
            if dst_ids:
                src = row_selector(src_rows)
                dst = w.device.index(dst_ids, w.kv_rows(0, 0))
                with self.lock:
                    if self.closed:
                        return
                    for layer_idx in group:
                        for p in range(self.num_planes):
                            start = ((layer_idx - group.start) * self.num_planes + p) * self.region_bytes
                            region = buf[start:start + self.region_bytes].view(w.layout.row_dtype).view(
                                self.rows_per_region, -1)
                            self._copy(layer_idx, p, dst, region, src)
                w.stats.add("copy_launches", len(group) * self.num_planes)
            else:  # nothing left to load: stop reading the remaining layer groups
                self.cancel()
        finally:  # (fenced: the reader fills it again only after its copies have read it)
            self._pool.release(bank, fence=self.events[-1] if self.events else None)

    def _deliver_direct_group(self, g: int) -> None:
        """The group's rows are already in the KV cache (direct receive): wait for them, then verify."""
        group = self.groups[g]
        if self.closed:
            return
        try:
            self._fills[g].result(timeout=max(0.0, self.deadline - time.monotonic()))
        except Exception as exc:  # deadline or a failed read task: nothing more can be trusted
            self._give_up(g, str(exc) or type(exc).__name__)
            return
        if self.closed:  # cancelled while the rows landed: vLLM may own those blocks again, leave them unread
            return
        with self.reads.lock:
            any_lost = bool(self.reads.missing or self.reads.errored)
        if any_lost:  # (a whole load of healthy stripes costs nothing per chunk here)
            for req, chunk, _parts, _src, _dst in self._plan:
                if self._alive(req, chunk):
                    self._chunk_present(req, chunk)
        assert self.direct is not None
        if self.w.config.verify_checksums:
            verify_group(self, group, self.direct.sums)
        if self.direct.deferred:  # blocks vLLM writes into as well: staged, verified, copied in now
            rows = [row for req, chunk, _parts, src, _dst in self._plan if self._alive(req, chunk)
                    for row in src if row in self.direct.deferred]
            with self.lock:
                if self.closed:
                    return
                self.direct.land_deferred(group, rows)
        if not any(self._alive(req, chunk) and dst for req, chunk, _parts, _src, dst in self._plan):
            self.cancel()  # nothing left to load: stop reading the remaining layer groups

    def _copy(self, layer_idx: int, plane_idx: int, dst: torch.Tensor, src_rows: torch.Tensor,
              src: slice | torch.Tensor) -> None:
        event = self.w.copy_rows(self.w.kv_rows(layer_idx, plane_idx), dst, src_rows, src)
        if event is not None:
            self.events.append(event)
            if self.mode != ASYNC:  # (the step's: attention's stream waits for them, no host synchronisation)
                self.w.layer_events[self.w.layer_names[layer_idx]] = event

    def fence(self) -> None:
        """Block until every copy this job queued has landed (a host synchronisation; no-op on host memory): before
        the request of an asynchronous, aborted or overrun load is reported finished."""
        self.w.device.synchronize(self.events)

    # ------------------------------------------------------------------ end
    def cancel(self) -> None:
        """Stop: no more writes into the KV cache (waits for a copy in progress), fills not started do nothing,
        banks still in flight are released by the reader when their fill ends."""
        self._cancelled.set()
        self._computing_since_s = None
        self._gate.close()
        with self.lock:
            self.closed = True
        for event in self._delivered:  # (a direct fill waiting for the consumer ends at once)
            event.set()
        for b in self._banks[self._next_group:]:
            self._abandon(b)
        self._next_group = len(self.groups) if hasattr(self, "groups") else 0

    def _abandon(self, bank) -> None:
        """Hand a bank that will not be delivered back: now if its fill ended, else by the reader when it ends."""
        bank.abandoned = True
        if bank.done.done():
            self._pool.release(bank)

    def finish(self) -> None:
        """Deliver what is left, settle the whole-stripe checks, and fill :attr:`done` (chunks that landed whole)
        and :attr:`failed_from`. Idempotent."""
        if self.finished:
            return
        if self.segments and not self.closed:
            self.deliver_through(self.num_layers - 1)
        self.cancel()
        self.finished = True
        if self.lent is not None:
            self.lent.settle()
        self.done = [(entry[1].chunk_hash, list(range(len(entry[1].tickets))), entry[-1]) for entry in self._plan
                     if self._alive(entry[0], entry[1])]
