"""Worker side: load promised chunks into the destination blocks, save new full chunks, report load errors.

Runs in each vLLM worker process, next to the KV tensors. A step's loads go layer group by layer group through the
transfer banks (:mod:`range_connector.banks`): one batched ranged read per shard fills a bank, then each layer is
verified (one checksum per chunk) and copied into the KV cache with one batched index copy per (layer, plane). A tier
that can lend its stripes (the in-process DRAM tier) skips the staging copy. A step's saves become, per shard, one
stripe write. The number of round trips, reads and copies follows shards, stripes, layers and bytes, never chunks
(DESIGN.md §3.1).

In this version loads complete inside ``start_load_kv`` (before the forward) and saves inside ``wait_for_save``
(after it): nothing stays in flight across steps, so preemption and block reuse cannot mix foreign KV into a stripe.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.backends.memory import MemoryBackend
from range_connector.banks import BankPool, BankReader
from range_connector.config import RangeConfig
from range_connector.errors import BackendError
from range_connector.layout import KVLayout, block_rows
from range_connector.metadata import RangeConnectorMetadata, RangeWorkerMetadata, RequestTransfer
from range_connector.namespace import ChunkHash
from range_connector.sharding import ShardPlan
from range_connector.stripes import (
    Segment,
    chunk_checksum,
    chunk_groups,
    gather_layer,
    new_stripe_id,
    plan_segments,
)
from range_connector.tickets import Ticket, ticket_key

logger = logging.getLogger("vllm." + __name__)


def _row_selector(src_rows: list[int]) -> slice | torch.Tensor:
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

    def rows(self, layer_idx: int, plane_idx: int) -> torch.Tensor:
        return self.tensors[layer_idx][plane_idx]

    def row_of(self, stripe_block: int) -> int:
        return stripe_block

    def check_whole(self) -> bool:
        """Every layer value matches the stripe's per-layer checksum (xxh3 releases the GIL: runs beside copies)."""
        return all(xxhash.xxh3_64_intdigest(v) == c for v, c in zip(self.layers, self.t.stripe_checksums))

    def chunk_bytes(self, layer_idx: int, plane_idx: int, t: Ticket) -> memoryview:
        start = (plane_idx * t.stripe_blocks + t.block_offset) * t.row_bytes
        return self.layers[layer_idx][start:start + t.num_blocks * t.row_bytes]


class RangeWorker:
    """Worker half of the connector.

    Args:
        config: resolved config.
        block_size: engine block size in tokens.
        layer_names: attention layers served, in model order.
        num_blocks: blocks per layer tensor.
        backends: ``[num_shards]`` backends.
        tp_rank: tensor-parallel rank (part of every ticket key).
    """

    def __init__(self, config: RangeConfig, block_size: int, layer_names: tuple[str, ...], num_blocks: int,
                 backends: list[Backend], tp_rank: int = 0) -> None:
        assert config.chunk_tokens is not None
        self.config = config
        self.block_size = block_size
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.plan = ShardPlan(config.chunk_tokens // block_size, config.num_shards)
        self.backends = backends
        self.tp_rank = tp_rank
        self.layout: KVLayout | None = None
        self._rows: list[torch.Tensor] = []
        self._banks = BankPool(config.num_banks)
        self._reader = BankReader()
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="range-verify")
        self._copy_stream = None  # CUDA only: the stream that copies banks into the KV cache
        self._layer_events: dict[str, object] = {}  # CUDA only: layer -> event of its last load copy
        self._failed_block_ids: set[int] = set()
        self._save_down_until = [0.0] * len(backends)  # per shard: monotonic time before which saves are skipped
        self._saved: list[tuple[ChunkHash, tuple[Ticket, ...]]] = []
        self._dropped: list[ChunkHash] = []
        self._loaded_reqs: list[str] = []
        # req_id -> first chunk whose load failed in this step: the forward computes on top of it, so nothing from
        # there on may be saved in this step (vLLM recomputes those blocks and they are saved then).
        self._failed_from_chunk: dict[str, int] = {}
        self._failed_loads: list[tuple[str, int]] = []
        #: block ids written by loads since :meth:`take_loaded_block_log` last ran (for inspection and tests).
        self.loaded_block_log: list[int] = []
        #: ``(shard_idx, ticket key)`` of the chunks that step read.
        self.last_loaded_tickets: list[tuple[int, bytes]] = []
        self.stats: dict[str, int] = defaultdict(int)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """View the engine's KV tensors as rows (see :func:`range_connector.layout.block_rows`)."""
        self.layout, self._rows = block_rows(kv_caches, self.layer_names, self.num_blocks)
        if self._rows and self._rows[0].is_cuda:  # pinned staging and a copy stream of our own
            self._banks = BankPool(self.config.num_banks, pin_memory=True)
            self._copy_stream = torch.cuda.Stream(device=self._rows[0].device)
        logger.info("Range worker: %d layers x %d planes, %d bytes per block row, %d blocks",
                    len(self.layer_names), self.layout.num_planes, self.layout.row_bytes, self.num_blocks)

    def _layer_block_bytes(self) -> int:
        assert self.layout is not None
        return self.layout.num_planes * self.layout.row_bytes

    def _ticket_fits(self, t: Ticket) -> bool:
        layout = self.layout
        assert layout is not None
        return (t.num_planes, t.row_bytes, t.num_layers, t.num_blocks) == (
            layout.num_planes, layout.row_bytes, len(self.layer_names), self.plan.blocks_per_shard)

    # ---------------------------------------------------------------- loads
    def start_load(self, meta: RangeConnectorMetadata) -> None:
        """Load every promised chunk of this step into its destination blocks, within ``load_deadline_s``.

        Blocks whose bytes are missing, corrupt, late or unreadable are reported through
        :meth:`take_failed_block_ids` (vLLM recomputes them). Never raises for a tier failure.
        """
        self._failed_from_chunk = {}
        if not meta.loads or self.layout is None:
            return
        deadline = time.monotonic() + self.config.load_deadline_s
        self.last_loaded_tickets = []
        loads = []
        for req in meta.loads:
            self._loaded_reqs.append(req.req_id)
            if req.fail or not req.chunks:
                if req.chunks:
                    self._fail_from(req, req.chunks[0].chunk_idx)
                continue
            loads.append(req)
        if loads:
            self._load(loads, deadline)

    def _load(self, reqs: list[RequestTransfer], deadline: float) -> None:
        layout = self.layout
        assert layout is not None
        num_layers, num_planes = len(self.layer_names), layout.num_planes
        # 1. Which chunks of which stripes: one segment (span of blocks) per (shard, stripe).
        wanted: dict[tuple[int, str], list[Ticket]] = defaultdict(list)
        bad_chunks: set[tuple[str, int]] = set()
        for req in reqs:
            for chunk in req.chunks:
                for s, t in enumerate(chunk.tickets):
                    if not self._ticket_fits(t):
                        bad_chunks.add((req.req_id, chunk.chunk_idx))
                    elif t not in wanted[(s, t.stripe_id)]:
                        wanted[(s, t.stripe_id)].append(t)
        segments = plan_segments(wanted)
        seg_of = {(seg.shard_idx, seg.ticket.stripe_id): seg for seg in segments}
        # 2. Bring the bytes within reach: views of the stored stripes where the tier can lend them (DRAM: no
        #    staging copy), else layer group by layer group through the transfer banks.
        if not all(self.backends[seg.shard_idx].supports_views for seg in segments):
            self._load_banked(reqs, segments, bad_chunks, deadline)
            return
        self._errored: set[tuple[int, str]] = set()
        sources, missing = self._view_sources(segments, deadline)
        if time.monotonic() > deadline:
            logger.warning("Range loads passed their %.1f s deadline", self.config.load_deadline_s)
            self.stats["load_deadline_misses"] += 1
            missing.update(seg_of)
        # 3. Stripes lent whole are verified against their per-layer checksums in a helper thread while the copies
        #    run (both are passes over memory; overlapping them is what keeps DRAM loads near a plain copy). Other
        #    chunks are verified one by one first. A chunk fails if any shard's slice is missing or bad.
        verify = self.config.verify_checksums
        pending = {key: self._verifier.submit(src.check_whole) for key, src in sources.items()
                   if verify and src.whole}
        failed_from: dict[str, int] = {}
        copied: list[tuple[RequestTransfer, object, list[int], list[tuple[int, Ticket]]]] = []
        copies: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))  # source -> (src, dst)
        for req in reqs:
            for chunk in req.chunks:
                good = (req.req_id, chunk.chunk_idx) not in bad_chunks
                for s, t in enumerate(chunk.tickets if good else ()):
                    if (s, t.stripe_id) in self._errored:
                        good = False
                        break
                    if (s, t.stripe_id) in missing:  # the stripe is gone: its ticket is not offered again
                        self._drop(chunk.chunk_hash, s)
                        good = False
                        break
                    if verify and (s, t.stripe_id) not in pending and not self._verify(sources[(s, t.stripe_id)], t):
                        good = False
                        self.stats["load_integrity_errors"] += 1
                        self._drop(chunk.chunk_hash, s)
                        break
                if not good:
                    failed_from[req.req_id] = chunk.chunk_idx
                    break
                dst_ids = []
                for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                    s, slot = self.plan.shard_of_block(pos)
                    t = chunk.tickets[s]
                    source = sources[(s, t.stripe_id)]
                    src, dst = copies[source.group]
                    src.append(source.row_of(t.block_offset + slot))
                    dst.append(block_id)
                    dst_ids.append(block_id)
                copied.append((req, chunk, dst_ids, list(enumerate(chunk.tickets))))
        # 4. One batched index copy per (layer, plane) and lent stripe.
        group_source = {src.group: src for src in sources.values()}
        for group, (src_rows, dst_ids) in copies.items():
            source = group_source[group]
            dst = torch.tensor(dst_ids, dtype=torch.long)
            src = _row_selector(src_rows)
            for layer_idx in range(num_layers):
                for p in range(num_planes):
                    self._copy_rows(layer_idx, self._rows[layer_idx * num_planes + p], dst, source.rows(layer_idx, p),
                                    src)
            self.stats["copy_launches"] += num_layers * num_planes
        # 5. A stripe that failed its whole check: find its bad chunks one by one. Their blocks (already written) and
        #    every later block of the request are reported, so vLLM recomputes them before anything reads them.
        bad_stripes = {key for key, fut in pending.items() if not fut.result()}
        done: list[tuple[ChunkHash, list[int], list[int]]] = []
        for req, chunk, dst_ids, parts in copied:
            if chunk.chunk_idx >= failed_from.get(req.req_id, 1 << 62):
                continue
            for s, t in parts:
                if (s, t.stripe_id) in bad_stripes and not self._verify(sources[(s, t.stripe_id)], t):
                    self.stats["load_integrity_errors"] += 1
                    self._drop(chunk.chunk_hash, s)
                    failed_from[req.req_id] = chunk.chunk_idx
                    break
            else:
                done.append((chunk.chunk_hash, [s for s, _ in parts], dst_ids))
        self._finish_load(reqs, failed_from, done)

    def _load_banked(self, reqs: list[RequestTransfer], segments: list[Segment], bad_chunks: set[tuple[str, int]],
                     deadline: float) -> None:
        """Load through the transfer banks, one layer group per bank, reads of the next group overlapping the
        verification and copy of this one.

        Every bank holds, for each of its layers and planes, a region with the segments in plan order; each fill is
        one batched ranged read per shard. A chunk that is missing on any shard, or fails its checksum in any
        layer, fails from there on (its request's later chunks too); blocks of a chunk that fails in a later layer
        were already written for earlier layers, which is harmless: they are reported and vLLM recomputes them.
        """
        layout = self.layout
        assert layout is not None
        num_layers, num_planes, row_bytes = len(self.layer_names), layout.num_planes, layout.row_bytes
        rows_per_region = sum(seg.num_blocks for seg in segments)
        region_bytes = rows_per_region * row_bytes
        layer_bytes = num_planes * region_bytes
        per_bank = max(1, self.config.bank_bytes // max(1, layer_bytes))
        groups = [range(g, min(num_layers, g + per_bank)) for g in range(0, num_layers, per_bank)]
        seg_of = {(seg.shard_idx, seg.ticket.stripe_id): seg for seg in segments}
        missing: set[tuple[int, str]] = set()  # stripes that are gone (their tickets lie: dropped)
        errored: set[tuple[int, str]] = set()  # stripes whose read failed (transient: tickets kept)
        missing_lock = threading.Lock()
        failed_shards: set[int] = set()  # a shard whose read failed is not asked again in this load
        cancelled = threading.Event()  # set when the load gives up: fills not yet started do nothing

        def fill_for(group: range):
            def fill(buffer: torch.Tensor) -> None:
                if cancelled.is_set():
                    return
                mv = memoryview(buffer.numpy()).cast("B")
                by_shard: dict[int, list[RangeRead]] = defaultdict(list)
                for seg in segments:
                    t = seg.ticket
                    for layer_idx in group:
                        for p in range(num_planes):
                            start = ((layer_idx - group.start) * num_planes + p) * region_bytes + seg.bank_row * row_bytes
                            length = seg.num_blocks * row_bytes
                            by_shard[seg.shard_idx].append(RangeRead(
                                t.stripe_id, layer_idx, (p * t.stripe_blocks + seg.first_block) * row_bytes, length,
                                t.layer_bytes, mv[start:start + length]))
                for s, reads in by_shard.items():
                    if cancelled.is_set() or s in failed_shards or time.monotonic() > deadline:
                        with missing_lock:
                            errored.update((s, r.stripe_id) for r in reads)
                        continue
                    try:
                        ok = self.backends[s].read_ranges(reads)
                        with missing_lock:
                            missing.update((s, r.stripe_id) for r, good in zip(reads, ok) if not good)
                    except ValueError as exc:  # a stored value disagrees with its ticket: find which, stripe by stripe
                        logger.warning("Range load from shard %d: %s", s, exc)
                        self.stats["load_integrity_errors"] += 1
                        self._reread_each_stripe(s, reads, missing, errored, missing_lock)
                    except BackendError as exc:
                        logger.warning("Range load from shard %d: %s", s, exc)
                        self.stats["load_backend_errors"] += 1
                        failed_shards.add(s)
                        with missing_lock:
                            errored.update((s, r.stripe_id) for r in reads)
            return fill

        timeout_s = max(0.0, deadline - time.monotonic())
        banks = [self._reader.submit(self._banks, len(g) * layer_bytes, fill_for(g), timeout_s) for g in groups]
        # Per chunk: where its blocks come from (rows of a region) and go (block ids); chains fail from a chunk on.
        plan = []  # (req, chunk, [(shard, ticket, segment)], src_rows, dst_ids)
        for req in reqs:
            for chunk in req.chunks:
                parts = [(s, t, seg_of.get((s, t.stripe_id))) for s, t in enumerate(chunk.tickets)]
                src_rows, dst_ids = [], []
                for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                    s, slot = self.plan.shard_of_block(pos)
                    seg = parts[s][2]
                    if seg is not None:
                        src_rows.append(seg.bank_row + parts[s][1].block_offset - seg.first_block + slot)
                        dst_ids.append(block_id)
                plan.append((req, chunk, parts, src_rows, dst_ids))
        failed_from: dict[str, int] = {}

        def fail(req: RequestTransfer, chunk_idx: int) -> None:
            failed_from[req.req_id] = min(failed_from.get(req.req_id, chunk_idx), chunk_idx)

        for req, chunk, parts, _, _ in plan:
            if (req.req_id, chunk.chunk_idx) in bad_chunks or any(seg is None for _, _, seg in parts):
                fail(req, chunk.chunk_idx)
        copied_blocks: set[int] = set()
        for g, group in enumerate(groups):
            bank = banks[g]
            try:
                bank.done.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # deadline, no free bank, or a failed fill: nothing more can be trusted
                logger.warning("Range load: layers %d-%d not delivered (%s)", group.start, group.stop - 1,
                               exc or type(exc).__name__)
                self.stats["load_deadline_misses"] += 1
                cancelled.set()
                for b in banks[g:]:
                    b.abandoned = True
                    if b.done.done():
                        self._banks.release(b)
                for req, chunk, _, _, _ in plan:
                    fail(req, chunk.chunk_idx)
                break
            with missing_lock:
                gone, broken = set(missing), set(errored)
            buf = bank.buffer
            # Segments that hold a whole stripe are verified once per layer; a chunk of a verified segment needs no
            # check of its own, a chunk of a failed one is checked alone (to fail only the bad chunks).
            whole_ok: dict[tuple[int, str], bool] = {}
            if self.config.verify_checksums:
                for seg in segments:
                    t = seg.ticket
                    if t.stripe_checksums and seg.first_block == 0 and seg.num_blocks == t.stripe_blocks:
                        whole_ok[(seg.shard_idx, t.stripe_id)] = self._verify_whole(
                            buf, group, seg, region_bytes, num_planes, row_bytes)
            for req, chunk, parts, _, _ in plan:
                if chunk.chunk_idx >= failed_from.get(req.req_id, 1 << 62):
                    continue
                lost = [s for s, t, _ in parts if (s, t.stripe_id) in gone]
                for s in lost:  # a ticket whose stripe is gone is not offered again
                    self._drop(chunk.chunk_hash, s)
                if lost or any((s, t.stripe_id) in broken for s, t, _ in parts):
                    fail(req, chunk.chunk_idx)
                    continue
                if self.config.verify_checksums:
                    for s, t, seg in parts:
                        if whole_ok.get((s, t.stripe_id)):
                            continue
                        if not self._verify_group(buf, group, seg, t, region_bytes, num_planes, row_bytes):
                            self.stats["load_integrity_errors"] += 1
                            self._drop(chunk.chunk_hash, s)
                            fail(req, chunk.chunk_idx)
                            break
            src_rows, dst_ids = [], []
            for req, chunk, _, c_src, c_dst in plan:
                if chunk.chunk_idx < failed_from.get(req.req_id, 1 << 62):
                    src_rows.extend(c_src)
                    dst_ids.extend(c_dst)
            if dst_ids:
                src = _row_selector(src_rows)
                dst = torch.tensor(dst_ids, dtype=torch.long)
                for layer_idx in group:
                    for p in range(num_planes):
                        start = ((layer_idx - group.start) * num_planes + p) * region_bytes
                        region = buf[start:start + region_bytes].view(layout.row_dtype).view(rows_per_region, -1)
                        self._copy_rows(layer_idx, self._rows[layer_idx * num_planes + p], dst, region, src)
                self.stats["copy_launches"] += len(group) * num_planes
                copied_blocks.update(dst_ids)
            self._bank_copied(group)
            self._banks.release(bank)
            if not dst_ids:  # nothing left to load: stop reading the remaining layer groups
                cancelled.set()
                for b in banks[g + 1:]:
                    b.abandoned = True
                    if b.done.done():
                        self._banks.release(b)
                break
        self.stats["bank_allocations"] = self._banks.allocations
        done = [(chunk.chunk_hash, [s for s, _, _ in parts], c_dst) for req, chunk, parts, _, c_dst in plan
                if chunk.chunk_idx < failed_from.get(req.req_id, 1 << 62)]
        self._finish_load(reqs, failed_from, done)

    def _finish_load(self, reqs: list[RequestTransfer], failed_from: dict[str, int],
                     done: list[tuple[ChunkHash, list[int], list[int]]]) -> None:
        """Record a load step: ``done`` = (chunk hash, shards, block ids written) of each chunk that landed whole;
        requests in ``failed_from`` fail from that chunk on (reported to vLLM, which recomputes)."""
        layout = self.layout
        assert layout is not None
        loaded = 0
        for chunk_hash, shards, dst_ids in done:
            loaded += len(dst_ids)
            self.loaded_block_log.extend(dst_ids)
            self.last_loaded_tickets.extend((s, ticket_key(chunk_hash, s, self.tp_rank)) for s in shards)
        for req in reqs:
            if req.req_id in failed_from:
                self._fail_from(req, failed_from[req.req_id])
        self.stats["loaded_blocks"] += loaded
        self.stats["loaded_tokens"] += loaded * self.block_size
        self.stats["loaded_bytes"] += loaded * layout.block_bytes

    def _copy_rows(self, layer_idx: int, dst_rows: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                   src: slice | torch.Tensor) -> None:
        """``dst_rows[dst] = src_rows[src]`` as one batched index copy.

        When the source rows are one run (the usual case: a chunk's blocks are consecutive in its stripe, and a
        bank holds segments back to back) the source is a view and the copy is the only pass over the bytes;
        otherwise the rows are gathered first. On CUDA the source is staged to the device on the copy stream.
        """
        picked = src_rows[src] if isinstance(src, slice) else src_rows.index_select(0, src)
        if not dst_rows.is_cuda:
            dst_rows.index_copy_(0, dst, picked)
            return
        stream = self._copy_stream
        assert stream is not None
        with torch.cuda.stream(stream):
            device = dst_rows.device
            staged = picked.to(device, non_blocking=True)  # from pinned host memory
            dst_rows.index_copy_(0, dst.to(device, non_blocking=True), staged)
            event = torch.cuda.Event()
            event.record(stream)
        self._layer_events[self.layer_names[layer_idx]] = event

    def _bank_copied(self, group: range) -> None:
        """Before a bank is reused, its device copies must have read it (CUDA); no-op on CPU."""
        for layer_idx in group:
            event = self._layer_events.get(self.layer_names[layer_idx])
            if event is not None:
                event.synchronize()

    def wait_for_layer(self, layer_name: str) -> None:
        """Make the current CUDA stream wait until this layer's loaded blocks have landed (no-op on CPU, where
        loads complete inside :meth:`start_load`)."""
        event = self._layer_events.pop(layer_name, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _reread_each_stripe(self, s: int, reads: list[RangeRead], missing: set, errored: set,
                            lock: threading.Lock) -> None:
        """After a shard's batched read was refused as inconsistent, read stripe by stripe (only on this error
        path) so that only the stripes whose values disagree with their tickets are treated as gone."""
        by_stripe: dict[str, list[RangeRead]] = defaultdict(list)
        for r in reads:
            by_stripe[r.stripe_id].append(r)
        for stripe_id, stripe_reads in by_stripe.items():
            try:
                ok = all(self.backends[s].read_ranges(stripe_reads))
                target = None if ok else missing
            except ValueError:
                target = missing
            except BackendError:
                target = errored
            if target is not None:
                with lock:
                    target.add((s, stripe_id))

    def _verify_whole(self, buf: torch.Tensor, group: range, seg: Segment, region_bytes: int, num_planes: int,
                      row_bytes: int) -> bool:
        """Check a segment that holds a whole stripe against the stripe's per-layer checksums."""
        mv = memoryview(buf.numpy()).cast("B")
        t = seg.ticket
        length = seg.num_blocks * row_bytes
        for layer_idx in group:
            h = xxhash.xxh3_64()
            for p in range(num_planes):
                start = ((layer_idx - group.start) * num_planes + p) * region_bytes + seg.bank_row * row_bytes
                h.update(mv[start:start + length])
            if h.intdigest() != t.stripe_checksums[layer_idx]:
                return False
        return True

    def _verify_group(self, buf: torch.Tensor, group: range, seg: Segment, t: Ticket, region_bytes: int,
                      num_planes: int, row_bytes: int) -> bool:
        mv = memoryview(buf.numpy()).cast("B")
        rel = (seg.bank_row + t.block_offset - seg.first_block) * row_bytes
        for layer_idx in group:
            h = xxhash.xxh3_64()
            for p in range(num_planes):
                start = ((layer_idx - group.start) * num_planes + p) * region_bytes + rel
                h.update(mv[start:start + t.num_blocks * row_bytes])
            if h.intdigest() != t.checksums[layer_idx]:
                logger.warning("Range load: checksum mismatch in stripe %s layer %d blocks [%d, %d)", t.stripe_id,
                               layer_idx, t.block_offset, t.block_offset + t.num_blocks)
                return False
        return True

    def _view_sources(self, segments: list[Segment], deadline: float) -> tuple[dict, set]:
        """Borrow read-only views of the stored stripes (one call per shard), no staging copy."""
        layout = self.layout
        assert layout is not None
        by_shard: dict[int, list[Segment]] = defaultdict(list)
        for seg in segments:
            by_shard[seg.shard_idx].append(seg)
        sources: dict = {}
        missing: set[tuple[int, str]] = set()
        for s, segs in by_shard.items():
            try:
                if time.monotonic() > deadline:
                    raise BackendError("the load deadline passed")
                views = self.backends[s].view_stripes([seg.ticket.stripe_id for seg in segs])
            except (BackendError, ValueError) as exc:  # transient: the chunks fail, their tickets stay
                logger.warning("Range load from shard %d: %s", s, exc)
                self.stats["load_backend_errors"] += 1
                self._errored.update((s, seg.ticket.stripe_id) for seg in segs)
                continue
            for seg, layers in zip(segs, views):
                key = (s, seg.ticket.stripe_id)
                if layers is None or len(layers) != len(self.layer_names) or any(
                        v.nbytes != seg.ticket.layer_bytes for v in layers):
                    missing.add(key)
                    continue
                source = _ViewSource(len(sources), seg.ticket, layers, layout.row_dtype)
                t = seg.ticket
                source.whole = bool(t.stripe_checksums) and seg.first_block == 0 and seg.num_blocks == t.stripe_blocks
                sources[key] = source
        return sources, missing

    def _verify(self, source: _ViewSource, t: Ticket) -> bool:
        for layer_idx in range(t.num_layers):
            h = xxhash.xxh3_64()
            for p in range(t.num_planes):
                h.update(source.chunk_bytes(layer_idx, p, t))
            if h.intdigest() != t.checksums[layer_idx]:
                logger.warning("Range load: checksum mismatch in stripe %s layer %d blocks [%d, %d)", t.stripe_id,
                               layer_idx, t.block_offset, t.block_offset + t.num_blocks)
                return False
        return True

    def _drop(self, chunk_hash: ChunkHash, shard_idx: int) -> None:
        """Forget a chunk whose bytes proved bad, so that it is not offered again."""
        self._dropped.append(chunk_hash)
        try:
            self.backends[shard_idx].delete_tickets([ticket_key(chunk_hash, shard_idx, self.tp_rank)])
        except BackendError as exc:
            logger.warning("Range: could not delete a bad ticket: %s", exc)

    def _fail_from(self, req: RequestTransfer, chunk_idx: int) -> None:
        failed = [b for c in req.chunks if c.chunk_idx >= chunk_idx for b in c.block_ids]
        self._failed_block_ids.update(failed)
        self._failed_from_chunk[req.req_id] = chunk_idx
        self._failed_loads.append((req.req_id, chunk_idx))
        self.stats["failed_blocks"] += len(failed)

    def take_loaded_block_log(self) -> list[int]:
        """Return and forget the block ids loaded since the last call (chain order within each step)."""
        out, self.loaded_block_log = self.loaded_block_log, []
        return out

    def take_failed_block_ids(self) -> set[int]:
        """Return and forget the block ids that failed to load since the last call."""
        out, self._failed_block_ids = self._failed_block_ids, set()
        return out

    # ---------------------------------------------------------------- saves
    def save(self, meta: RangeConnectorMetadata) -> None:
        """Write this step's new full chunks as one stripe per shard (split at the tier's value limit).

        A failed or skipped write is counted, never raised: a lost save is only a future miss.
        """
        if not meta.saves or self.layout is None:
            return
        layout = self.layout
        chunks = []  # (chunk_hash, block ids of the whole chunk)
        for req in meta.saves:
            failed_from = self._failed_from_chunk.get(req.req_id)
            for c in req.chunks:
                if failed_from is not None and c.chunk_idx >= failed_from:
                    self.stats["saves_dropped_after_failed_load"] += 1
                    continue
                chunks.append((c.chunk_hash, c.block_ids))
        if not chunks:
            return
        bps = self.plan.blocks_per_shard
        tickets_by_chunk: dict[ChunkHash, list[Ticket | None]] = {h: [None] * self.plan.num_shards for h, _ in chunks}
        for s, backend in enumerate(self.backends):
            if time.monotonic() < self._save_down_until[s]:
                self.stats["saves_skipped"] += 1
                continue
            try:
                groups = chunk_groups(len(chunks), bps, self._layer_block_bytes(), backend.max_value_bytes)
            except ValueError as exc:
                logger.warning("Range save to shard %d: %s", s, exc)
                self.stats["save_errors"] += 1
                continue
            for group in groups:
                self._save_stripe(s, backend, [chunks[i] for i in group], tickets_by_chunk)
        for h, tickets in tickets_by_chunk.items():
            if all(t is not None for t in tickets):
                self._saved.append((h, tuple(tickets)))  # type: ignore[arg-type]
                self.stats["saved_chunks"] += 1

    def _save_stripe(self, s: int, backend: Backend, chunks: list[tuple[ChunkHash, tuple[int, ...]]],
                     tickets_by_chunk: dict[ChunkHash, list[Ticket | None]]) -> None:
        layout = self.layout
        assert layout is not None
        bps = self.plan.blocks_per_shard
        positions = list(self.plan.shard_blocks(s))
        block_ids = [ids[p] for _, ids in chunks for p in positions]
        index = torch.tensor(block_ids, dtype=torch.long)
        stripe_blocks = len(block_ids)
        if self._rows[0].is_cuda:  # gather on the device, one device-to-host copy per layer
            index = index.to(self._rows[0].device)
            values = [gather_layer(self._rows, layout, layer_idx, index).cpu()
                      for layer_idx in range(len(self.layer_names))]
        else:
            values = [gather_layer(self._rows, layout, layer_idx, index) for layer_idx in range(len(self.layer_names))]
        views = [memoryview(v.view(torch.uint8).numpy()).cast("B") for v in values]
        stripe_id = new_stripe_id()
        stripe_sums = tuple(xxhash.xxh3_64_intdigest(v) for v in views)
        tickets = []
        for c, (chunk_hash, _) in enumerate(chunks):
            sums = tuple(chunk_checksum(v, layout.num_planes, stripe_blocks, c * bps, bps, layout.row_bytes)
                         for v in views)
            t = Ticket(stripe_id, c * bps, bps, stripe_blocks, len(self.layer_names), layout.num_planes,
                       layout.row_bytes, sums, stripe_sums)
            tickets.append((chunk_hash, t))
        write = StripeWrite(stripe_id, views, [(ticket_key(h, s, self.tp_rank), t.encode()) for h, t in tickets])
        try:
            stored = backend.write_stripe(write)
        except (BackendError, ValueError) as exc:
            logger.warning("Range save to shard %d failed: %s", s, exc)
            self.stats["save_errors"] += 1
            if isinstance(exc, BackendError):
                self._save_down_until[s] = time.monotonic() + self.config.backend_retry_s
            return
        if not stored:
            self.stats["saves_skipped_capacity"] += 1
            return
        self.stats["saved_bytes"] += write.nbytes
        self.stats["saved_stripes"] += 1
        for h, t in tickets:
            tickets_by_chunk[h][s] = t

    # ---------------------------------------------------------------- to the scheduler
    def build_worker_meta(self) -> RangeWorkerMetadata | None:
        """Saves completed, loads finished, and chunks dropped since the last call."""
        dropped = list(self._dropped)
        for b in {id(b): b for b in self.backends}.values():
            if isinstance(b, MemoryBackend):
                for key in b.take_evicted():
                    dropped.append(ChunkHash(bytes.fromhex(key.split(b":")[2].decode())))
        if not (self._saved or dropped or self._failed_loads or self._loaded_reqs):
            return None
        meta = RangeWorkerMetadata(saved=self._saved, dropped=dropped, failed_loads=self._failed_loads,
                                   loaded=self._loaded_reqs)
        self._saved, self._dropped, self._failed_loads, self._loaded_reqs = [], [], [], []
        return meta

    def close(self) -> None:
        """Release backend connections and the bank reader."""
        self._reader.close()
        self._verifier.shutdown(wait=False)
        for b in {id(b): b for b in self.backends}.values():
            b.close()
