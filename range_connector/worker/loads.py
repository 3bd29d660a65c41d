"""One batch of loads, delivered into the KV cache layer group by layer group (worker side).

A :class:`LoadJob` covers the chunks of one or more requests that are loaded together. :meth:`LoadJob.start`
plans the reads (one segment per (shard, stripe)) and either borrows read-only views of the stored stripes (a tier
that can lend them: the in-process DRAM tier), or queues one read per layer group on the transfer banks' reader
thread (:mod:`range_connector.worker.banks`): into a bank, or, when the KV cache is in host memory and the tier can
scatter, straight into the destination blocks (:mod:`range_connector.worker.direct_receive`). :meth:`LoadJob.deliver_through`
then delivers the groups up to a layer, in order: it waits for the group's read (bounded by the job's deadline),
verifies the chunks against their checksums and, from a bank, copies them into the destination blocks with one
batched index copy per (layer, plane). Who calls it decides the load mode (DESIGN.md §4 "Load"):

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
import warnings
from collections import defaultdict
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
import xxhash

from range_connector.backends.base import RangeRead
from range_connector.config import LOAD_MODES
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.kv.metadata import ChunkTransfer, RequestTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.stripes import Segment, plan_segments
from range_connector.kv.tickets import Ticket
from range_connector.worker.direct_receive import DirectRows, WriteGate

if TYPE_CHECKING:
    from range_connector.worker.context import LoadContext

logger = logging.getLogger("vllm." + __name__)

_NEVER = 1 << 62

#: load modes (``RequestTransfer.mode``, config key ``load_mode``)
PIPELINED, ASYNC, SYNC = LOAD_MODES[:3]  # ("auto" is the scheduler's: it picks one of these)


def row_selector(src_rows: list[int]) -> slice | torch.Tensor:
    """A slice when ``src_rows`` is one ascending run of consecutive rows (no gather needed), else an index."""
    first = src_rows[0]
    if src_rows == list(range(first, first + len(src_rows))):
        return slice(first, first + len(src_rows))
    return torch.tensor(src_rows, dtype=torch.long)


class _ViewSource:
    """A stripe lent by the tier as read-only layer values ``[num_planes, stripe_blocks, row_bytes]``."""

    def __init__(self, group: int, t: Ticket, layers: list[memoryview], row_dtype: torch.dtype) -> None:
        self.group, self.t, self.layers = group, t, layers
        #: the load reads the whole stripe, which carries per-layer checksums: verified once per layer.
        self.whole = False
        with warnings.catch_warnings():  # read-only buffers: only ever read (the index copy copies out)
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.tensors = [torch.frombuffer(v, dtype=torch.uint8).view(row_dtype).view(t.num_planes,
                                                                                        t.stripe_blocks, -1)
                            for v in layers]

    def check_whole(self) -> bool:
        """Every layer value matches the stripe's per-layer checksum (xxh3 releases the GIL: runs beside copies)."""
        return all(xxhash.xxh3_64_intdigest(v) == c for v, c in zip(self.layers, self.t.stripe_checksums))

    def check_chunk(self, t: Ticket) -> bool:
        """The chunk of ticket ``t`` matches its per-layer checksums."""
        for layer_idx in range(t.num_layers):
            h = xxhash.xxh3_64()
            for p in range(t.num_planes):
                start = (p * t.stripe_blocks + t.block_offset) * t.row_bytes
                h.update(self.layers[layer_idx][start:start + t.num_blocks * t.row_bytes])
            if h.intdigest() != t.checksums[layer_idx]:
                logger.warning("Range load: checksum mismatch in stripe %s layer %d blocks [%d, %d)", t.stripe_id,
                               layer_idx, t.block_offset, t.block_offset + t.num_blocks)
                return False
        return True


class LoadJob:
    """Loads of one or more requests, delivered layer group by layer group.

    Args:
        context: what the job may use of its worker: KV rows, backends, banks, threads and counters.
        reqs: the requests' load plans (from the scheduler's metadata).
        deadline: ``time.monotonic()`` after which nothing more is waited for (those chunks fail).
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
        self.deadline = deadline
        self.mode = mode
        self.lock = threading.Lock()
        self.closed = False
        self.finished = False
        #: the load ran out of its deadline (or found no bank in time) before every layer was in reach
        self.deadline_missed = False
        self.started_s = time.monotonic()
        self.failed_from: dict[str, int] = {}
        self.num_layers = len(context.layer_names)
        self.num_planes, self.row_bytes = layout.num_planes, layout.row_bytes
        self.layer_ready_s: list[float | None] = [None] * self.num_layers
        self.layer_delivered_s: list[float | None] = [None] * self.num_layers
        self.layer_waited_s: list[float | None] = [None] * self.num_layers
        self.events: list[object] = []  # CUDA events of this job's copies
        self._next_group = 0
        self._cancelled = threading.Event()
        self._missing: set[tuple[int, str]] = set()  # stripes that are gone (their tickets lie: dropped)
        self._errored: set[tuple[int, str]] = set()  # stripes whose read failed (transient: tickets kept)
        self._state_lock = threading.Lock()
        self._failed_shards: set[int] = set()
        self._banks: list = []
        #: direct receive (CPU): where each row lands, and one read per layer group on the reader thread
        self.direct: DirectRows | None = None
        self._fills: list[Future] = []
        self._gate = WriteGate()
        self._views: dict[tuple[int, str], _ViewSource] = {}
        self._pending_whole: dict[tuple[int, str], Future] = {}
        self._delivered: list[threading.Event] = []  # direct receive: per layer group, delivered (or cancelled)
        self.done: list[tuple[ChunkHash, list[int], list[int]]] = []  # filled by finish()

    # ------------------------------------------------------------------ set-up
    def _fail(self, req_id: str, chunk_idx: int) -> None:
        self.failed_from[req_id] = min(self.failed_from.get(req_id, chunk_idx), chunk_idx)

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
        self.segments = plan_segments(wanted)
        self._seg_of = {(seg.shard_idx, seg.ticket.stripe_id): seg for seg in self.segments}
        self.views = bool(self.segments) and all(w.backends[seg.shard_idx].supports_views for seg in self.segments)
        if self.views:
            self.groups = [range(layer, layer + 1) for layer in range(self.num_layers)]
            self._start_views()
        else:
            self._start_banked()

    def _start_views(self) -> None:
        """Borrow read-only views of the stored stripes (one call per shard): no staging copy. Stripes lent whole
        are verified against their per-layer checksums in a helper thread while the copies run; partial ones
        chunk by chunk, here."""
        w = self.w
        by_shard: dict[int, list[Segment]] = defaultdict(list)
        for seg in self.segments:
            by_shard[seg.shard_idx].append(seg)
        for s, segs in by_shard.items():
            try:
                if time.monotonic() > self.deadline:
                    raise BackendError("the load deadline passed")
                lent = w.backends[s].view_stripes([seg.ticket.stripe_id for seg in segs])
            except (BackendError, ValueError) as exc:  # transient: the chunks fail, their tickets stay
                logger.warning("Range load from shard %d: %s", s, exc)
                w.stats["load_backend_errors"] += 1
                self._errored.update((s, seg.ticket.stripe_id) for seg in segs)
                continue
            for seg, layers in zip(segs, lent):
                key, t = (s, seg.ticket.stripe_id), seg.ticket
                if layers is None or len(layers) != self.num_layers or any(v.nbytes != t.layer_bytes for v in layers):
                    self._missing.add(key)
                    continue
                source = _ViewSource(len(self._views), t, layers, w.layout.row_dtype)
                source.whole = bool(t.stripe_checksums) and seg.first_block == 0 and seg.num_blocks == t.stripe_blocks
                self._views[key] = source
        now = time.monotonic()
        self.layer_ready_s = [now] * self.num_layers
        verify = w.config.verify_checksums
        self._pending_whole = {key: w.verifier.submit(src.check_whole) for key, src in self._views.items()
                               if verify and src.whole}
        # Copies per lent stripe: (source rows, destination block ids), the same in every layer.
        self._view_copies: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        self._plan = []
        for req in self.reqs:
            for chunk in req.chunks:
                if not self._alive(req, chunk) or not self._chunk_present(req, chunk):
                    continue
                if verify and not all(self._pending_whole.get((s, t.stripe_id)) is not None
                                      or self._views[(s, t.stripe_id)].check_chunk(t)
                                      for s, t in enumerate(chunk.tickets)):
                    w.stats["load_integrity_errors"] += 1
                    self._drop_bad(req, chunk)
                    continue
                dst_ids = []
                for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                    s, slot = w.plan.shard_of_block(pos)
                    t = chunk.tickets[s]
                    src, dst = self._view_copies[self._views[(s, t.stripe_id)].group]
                    src.append(t.block_offset + slot)
                    dst.append(block_id)
                    dst_ids.append(block_id)
                self._plan.append((req, chunk, dst_ids))

    def _drop_bad(self, req: RequestTransfer, chunk: ChunkTransfer) -> None:
        """Fail a chunk whose bytes are corrupt on some shard and forget it on the shards where it is."""
        for s, t in enumerate(chunk.tickets):
            source = self._views.get((s, t.stripe_id))
            if source is not None and not source.check_chunk(t):
                self.w.drop(chunk.chunk_hash, s)
        self._fail(req.req_id, chunk.chunk_idx)

    def _chunk_present(self, req: RequestTransfer, chunk: ChunkTransfer) -> bool:
        """False (and the chunk fails) if a shard's stripe is gone (its ticket is dropped) or unreadable."""
        with self._state_lock:
            gone, broken = set(self._missing), set(self._errored)
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
        if not w.kv_rows(0, 0).is_cuda and all(w.backends[seg.shard_idx].supports_scatter for seg in self.segments):
            self.direct = DirectRows.plan(w.kv_rows, self.num_layers, num_planes, row_bytes, self.segments,
                                          self.rows_per_region, [(e[3], e[4]) for e in self._plan])
        if self.direct is not None:
            # Read-ahead stays bounded as on the bank path (num_banks layer groups beyond the last one delivered),
            # so a layer-pipelined load keeps handing early layers to attention while later ones are still read.
            self._delivered = [threading.Event() for _ in self.groups]
            self._fills = [w.reader.submit_task(self._fill_for(g)) for g in self.groups]
            return
        timeout_s = max(0.0, self.deadline - time.monotonic())
        self._banks = [w.reader.submit(w.banks, len(g) * layer_bytes, self._fill_for(g), timeout_s)
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
                if behind >= 0 and not self._delivered[behind].wait(max(0.0, self.deadline - time.monotonic())):
                    raise BackendTimeoutError("the load deadline passed before earlier layer groups were delivered")
                if self._cancelled.is_set():
                    return
                by_shard = self.direct.reads(group, self._gate, w.config.verify_checksums)
            else:
                by_shard = bank_reads(buffer)
            if len(by_shard) > 1:  # shards live on different servers: read them at the same time
                for fut in [w.shard_readers.submit(self._read_shard, s, reads) for s, reads in by_shard.items()]:
                    fut.result()
            else:
                for s, reads in by_shard.items():
                    self._read_shard(s, reads)
            now = time.monotonic()
            for layer_idx in group:
                self.layer_ready_s[layer_idx] = now

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

    def _read_shard(self, s: int, reads: list[RangeRead]) -> None:
        """One batched ranged read of one shard into the bank; failures are recorded, never raised."""
        w = self.w
        if self._cancelled.is_set() or s in self._failed_shards or time.monotonic() > self.deadline:
            with self._state_lock:
                self._errored.update((s, r.stripe_id) for r in reads)
            return
        try:
            ok = w.backends[s].read_ranges(reads)
            with self._state_lock:
                self._missing.update((s, r.stripe_id) for r, good in zip(reads, ok) if not good)
        except ValueError as exc:  # a stored value disagrees with its ticket: find which, stripe by stripe
            logger.warning("Range load from shard %d: %s", s, exc)
            w.stats["load_integrity_errors"] += 1
            self._reread_each_stripe(s, reads)
        except BackendError as exc:
            if not self._cancelled.is_set():  # (a cancelled direct receive ends with its gate's refusal)
                logger.warning("Range load from shard %d: %s", s, exc)
                w.stats["load_backend_errors"] += 1
            self._failed_shards.add(s)
            with self._state_lock:
                self._errored.update((s, r.stripe_id) for r in reads)

    def _reread_each_stripe(self, s: int, reads: list[RangeRead]) -> None:
        """After a shard's batched read was refused as inconsistent, read stripe by stripe (only on this error
        path) so that only the stripes whose values disagree with their tickets are treated as gone."""
        by_stripe: dict[str, list[RangeRead]] = defaultdict(list)
        for r in reads:
            by_stripe[r.stripe_id].append(r)
        for stripe_id, stripe_reads in by_stripe.items():
            try:
                target = None if all(self.w.backends[s].read_ranges(stripe_reads)) else self._missing
            except ValueError:
                target = self._missing
            except BackendError:
                target = self._errored
            if target is not None:
                with self._state_lock:
                    target.add((s, stripe_id))

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
        while self._next_group <= last:
            g = self._next_group
            self._next_group += 1
            if self.views:
                self._deliver_view_group(g)
            elif self.direct is not None:
                self._deliver_direct_group(g)
            else:
                self._deliver_bank_group(g)
            now = time.monotonic()
            for layer in self.groups[g]:
                self.layer_delivered_s[layer] = now
            if self._delivered:
                self._delivered[g].set()

    def _deliver_view_group(self, g: int) -> None:
        if time.monotonic() > self.deadline:
            self._give_up(g, "the load deadline passed")
            return
        group_source = {src.group: src for src in self._views.values()}
        with self.lock:
            if self.closed:
                return
            for group_idx, (src_rows, dst_ids) in self._view_copies.items():
                source = group_source[group_idx]
                dst = torch.tensor(dst_ids, dtype=torch.long)
                src = row_selector(src_rows)
                for layer_idx in self.groups[g]:
                    for p in range(self.num_planes):
                        self._copy(layer_idx, p, dst, source.tensors[layer_idx][p], src)
                self.w.stats["copy_launches"] += len(self.groups[g]) * self.num_planes

    def _give_up(self, g: int, why: str) -> None:
        """Layers from group ``g`` on will not be delivered: every chunk of the job fails."""
        logger.warning("Range load: layers %d-%d not delivered (%s)", self.groups[g].start,
                       self.groups[-1].stop - 1, why)
        self.w.stats["load_deadline_misses"] += 1
        self.deadline_missed = True
        self.cancel()
        for req in self.reqs:
            if req.chunks:
                self._fail(req.req_id, req.chunks[0].chunk_idx)

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
                self._verify_group(group, lambda grp, row, n: self._bank_sums(buf, grp, row, n))
            src_rows, dst_ids = [], []
            for req, chunk, _parts, c_src, c_dst in self._plan:
                if self._alive(req, chunk):
                    src_rows.extend(c_src)
                    dst_ids.extend(c_dst)
            if dst_ids:
                src = row_selector(src_rows)
                dst = torch.tensor(dst_ids, dtype=torch.long)
                with self.lock:
                    if self.closed:
                        return
                    for layer_idx in group:
                        for p in range(self.num_planes):
                            start = ((layer_idx - group.start) * self.num_planes + p) * self.region_bytes
                            region = buf[start:start + self.region_bytes].view(w.layout.row_dtype).view(
                                self.rows_per_region, -1)
                            self._copy(layer_idx, p, dst, region, src)
                w.stats["copy_launches"] += len(group) * self.num_planes
            else:  # nothing left to load: stop reading the remaining layer groups
                self.cancel()
        finally:
            self._bank_copied()
            w.banks.release(bank)

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
        with self._state_lock:
            any_lost = bool(self._missing or self._errored)
        if any_lost:  # (a whole load of healthy stripes costs nothing per chunk here)
            for req, chunk, _parts, _src, _dst in self._plan:
                if self._alive(req, chunk):
                    self._chunk_present(req, chunk)
        if self.w.config.verify_checksums:
            assert self.direct is not None
            self._verify_group(group, self.direct.sums)
        if not any(self._alive(req, chunk) and dst for req, chunk, _parts, _src, dst in self._plan):
            self.cancel()  # nothing left to load: stop reading the remaining layer groups

    def _verify_group(self, group: range, sums_of) -> None:
        """Segments that hold a whole stripe are verified once per layer; a chunk of a verified segment needs no
        check of its own, a chunk of a failed one is checked alone (to fail only the bad chunks).

        ``sums_of(group, first_row, num_rows)`` -> per layer of the group, xxh3 of those rows of every plane."""
        whole_ok: dict[tuple[int, str], bool] = {}
        for seg in self.segments:
            t = seg.ticket
            if t.stripe_checksums and seg.first_block == 0 and seg.num_blocks == t.stripe_blocks:
                sums = sums_of(group, seg.bank_row, seg.num_blocks)
                whole_ok[(seg.shard_idx, t.stripe_id)] = sums == [t.stripe_checksums[i] for i in group]
        if len(whole_ok) == len(self.segments) and all(whole_ok.values()):
            return  # every segment is a whole stripe that verified: so is every chunk in it
        for req, chunk, parts, _src, _dst in self._plan:
            if not self._alive(req, chunk):
                continue
            for s, t, seg in parts:
                if whole_ok.get((s, t.stripe_id)):
                    continue
                rel = seg.bank_row + t.block_offset - seg.first_block
                if sums_of(group, rel, t.num_blocks) != [t.checksums[i] for i in group]:
                    logger.warning("Range load: checksum mismatch in stripe %s layers %d-%d blocks [%d, %d)",
                                   t.stripe_id, group.start, group.stop - 1, t.block_offset,
                                   t.block_offset + t.num_blocks)
                    self.w.stats["load_integrity_errors"] += 1
                    self.w.drop(chunk.chunk_hash, s)
                    self._fail(req.req_id, chunk.chunk_idx)
                    break

    def _bank_sums(self, buf: torch.Tensor, group: range, first_row: int, num_rows: int) -> list[int]:
        """xxh3 of rows ``[first_row, first_row + num_rows)`` of every plane, per layer of the group."""
        mv = memoryview(buf.numpy()).cast("B")
        out = []
        for layer_idx in group:
            h = xxhash.xxh3_64()
            for p in range(self.num_planes):
                start = ((layer_idx - group.start) * self.num_planes + p) * self.region_bytes + first_row * self.row_bytes
                h.update(mv[start:start + num_rows * self.row_bytes])
            out.append(h.intdigest())
        return out

    def _copy(self, layer_idx: int, plane_idx: int, dst: torch.Tensor, src_rows: torch.Tensor,
              src: slice | torch.Tensor) -> None:
        event = self.w.copy_rows(self.w.kv_rows(layer_idx, plane_idx), dst, src_rows, src)
        if event is not None:
            self.events.append(event)
            if self.mode == PIPELINED:
                self.w.layer_events[self.w.layer_names[layer_idx]] = event

    def _bank_copied(self) -> None:
        """Before a bank is reused, its device copies must have read it (CUDA); no-op on CPU."""
        for event in self.events:
            event.synchronize()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ end
    def cancel(self) -> None:
        """Stop: no more writes into the KV cache (waits for a copy in progress), fills not started do nothing,
        banks still in flight are released by the reader when their fill ends."""
        self._cancelled.set()
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
            self.w.banks.release(bank)

    def finish(self) -> None:
        """Deliver what is left, settle the whole-stripe checks, and fill :attr:`done` (chunks that landed whole)
        and :attr:`failed_from`. Idempotent."""
        if self.finished:
            return
        if self.segments and not self.closed:
            self.deliver_through(self.num_layers - 1)
        self.cancel()
        self.finished = True
        self._bank_copied()
        if self.views:
            bad = {key for key, fut in self._pending_whole.items() if not fut.result()}
            for req, chunk, _dst in self._plan:
                if self._alive(req, chunk) and any((s, t.stripe_id) in bad and not self._views[(s, t.stripe_id)]
                                                   .check_chunk(t) for s, t in enumerate(chunk.tickets)):
                    self.w.stats["load_integrity_errors"] += 1
                    self._drop_bad(req, chunk)
        self.done = [(entry[1].chunk_hash, list(range(len(entry[1].tickets))), entry[-1]) for entry in self._plan
                     if self._alive(entry[0], entry[1])]
