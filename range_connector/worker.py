"""Worker side: load promised chunks into the destination blocks, save new full chunks, report load errors.

Runs in each vLLM worker process, next to the KV tensors. A step's loads become, per shard, one batched ranged read
into a transfer bank (one staging buffer, reused across steps), then per (layer, plane) one checksum pass per chunk
and one batched index copy into the KV cache; a step's saves become, per shard, one stripe write. The number of
round trips, reads and copies follows shards, stripes and layers, never chunks (DESIGN.md §3.1).

In this version loads complete inside ``start_load_kv`` (before the forward) and saves inside ``wait_for_save``
(after it): nothing stays in flight across steps, so preemption and block reuse cannot mix foreign KV into a stripe.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping

import torch

from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.backends.memory import MemoryBackend
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
        self._bank = torch.empty(0, dtype=torch.uint8)  # the transfer bank, grown on demand and reused
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
        num_layers, num_planes, row_bytes = len(self.layer_names), layout.num_planes, layout.row_bytes
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
        rows_per_region = sum(seg.num_blocks for seg in segments)
        region_bytes = rows_per_region * row_bytes
        total = region_bytes * num_layers * num_planes
        if self._bank.numel() < total:
            self._bank = torch.empty(total, dtype=torch.uint8)
            self.stats["bank_allocations"] += 1
        bank = self._bank[:total]
        bank_mv = memoryview(bank.numpy()).cast("B")

        def region(layer_idx: int, plane_idx: int) -> int:
            return (layer_idx * num_planes + plane_idx) * region_bytes

        # 2. One batched ranged read per shard (all layers, all stripes).
        reads_by_shard: dict[int, list[RangeRead]] = defaultdict(list)
        for seg in segments:
            t = seg.ticket
            for layer_idx in range(num_layers):
                for p in range(num_planes):
                    offset = (p * t.stripe_blocks + seg.first_block) * row_bytes
                    length = seg.num_blocks * row_bytes
                    start = region(layer_idx, p) + seg.bank_row * row_bytes
                    reads_by_shard[seg.shard_idx].append(RangeRead(
                        t.stripe_id, layer_idx, offset, length, t.layer_bytes, bank_mv[start:start + length]))
        missing: set[tuple[int, str]] = set()
        for s, reads in reads_by_shard.items():
            if time.monotonic() > deadline:
                missing.update((s, r.stripe_id) for r in reads)
                continue
            try:
                ok = self.backends[s].read_ranges(reads)
            except (BackendError, ValueError) as exc:
                logger.warning("Range load from shard %d: %s", s, exc)
                self.stats["load_backend_errors"] += 1
                missing.update((s, r.stripe_id) for r in reads)
                continue
            missing.update((s, r.stripe_id) for r, good in zip(reads, ok) if not good)
        if time.monotonic() > deadline:
            logger.warning("Range loads passed their %.1f s deadline", self.config.load_deadline_s)
            self.stats["load_deadline_misses"] += 1
            missing.update(seg_of)
        # 3. Verify each chunk's bytes in each layer; a chunk fails if any shard's slice is missing or bad.
        dst_ids: list[int] = []
        src_rows: list[int] = []
        for req in reqs:
            failed_from = None
            for chunk in req.chunks:
                key = (req.req_id, chunk.chunk_idx)
                good = key not in bad_chunks
                for s, t in enumerate(chunk.tickets if good else ()):
                    if (s, t.stripe_id) in missing:
                        good = False
                        break
                    seg = seg_of[(s, t.stripe_id)]
                    if self.config.verify_checksums and not self._verify(bank_mv, seg, t, region, region_bytes):
                        good = False
                        self.stats["load_integrity_errors"] += 1
                        self._drop(chunk.chunk_hash, s)
                        break
                if not good:
                    failed_from = chunk.chunk_idx
                    break
                for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                    s, slot = self.plan.shard_of_block(pos)
                    t = chunk.tickets[s]
                    seg = seg_of[(s, t.stripe_id)]
                    src_rows.append(seg.bank_row + t.block_offset - seg.first_block + slot)
                    dst_ids.append(block_id)
                    self.last_loaded_tickets.append((s, ticket_key(chunk.chunk_hash, s, self.tp_rank)))
            if failed_from is not None:
                self._fail_from(req, failed_from)
        # 4. One batched copy per (layer, plane) from the bank into the KV cache.
        if dst_ids:
            dst = torch.tensor(dst_ids, dtype=torch.long)
            src = torch.tensor(src_rows, dtype=torch.long)
            for layer_idx in range(num_layers):
                for p in range(num_planes):
                    start = region(layer_idx, p)
                    view = bank[start:start + region_bytes].view(layout.row_dtype).view(rows_per_region, -1)
                    self._rows[layer_idx * num_planes + p][dst] = view[src]
            self.stats["copy_launches"] += num_layers * num_planes
            self.loaded_block_log.extend(dst_ids)
            self.stats["loaded_blocks"] += len(dst_ids)
            self.stats["loaded_tokens"] += len(dst_ids) * self.block_size
            self.stats["loaded_bytes"] += len(dst_ids) * layout.block_bytes

    def _verify(self, bank_mv: memoryview, seg: Segment, t: Ticket, region, region_bytes: int) -> bool:
        row_bytes = t.row_bytes
        rel = t.block_offset - seg.first_block
        for layer_idx in range(t.num_layers):
            # The segment's rows of this layer, plane after plane, laid out like a stripe of seg.num_blocks blocks.
            start = region(layer_idx, 0) + seg.bank_row * row_bytes
            if t.num_planes == 1:
                view = bank_mv[start:start + seg.num_blocks * row_bytes]
                got = chunk_checksum(view, 1, seg.num_blocks, rel, t.num_blocks, row_bytes)
            else:
                import xxhash

                h = xxhash.xxh3_64()
                for p in range(t.num_planes):
                    ps = region(layer_idx, p) + (seg.bank_row + rel) * row_bytes
                    h.update(bank_mv[ps:ps + t.num_blocks * row_bytes])
                got = h.intdigest()
            if got != t.checksums[layer_idx]:
                logger.warning("Range load: checksum mismatch in %s stripe %s layer %d blocks [%d, %d)",
                               self.backends[seg.shard_idx].name, t.stripe_id, layer_idx, t.block_offset,
                               t.block_offset + t.num_blocks)
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
        values = [gather_layer(self._rows, layout, layer_idx, index) for layer_idx in range(len(self.layer_names))]
        views = [memoryview(v.view(torch.uint8).numpy()).cast("B") for v in values]
        stripe_id = new_stripe_id()
        tickets = []
        for c, (chunk_hash, _) in enumerate(chunks):
            sums = tuple(chunk_checksum(v, layout.num_planes, stripe_blocks, c * bps, bps, layout.row_bytes)
                         for v in views)
            t = Ticket(stripe_id, c * bps, bps, stripe_blocks, len(self.layer_names), layout.num_planes,
                       layout.row_bytes, sums)
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
        """Release backend connections."""
        for b in {id(b): b for b in self.backends}.values():
            b.close()
