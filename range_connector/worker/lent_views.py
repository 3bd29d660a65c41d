"""Loads from a tier that lends its stripes in process (the DRAM tier): no staging copy and no read.

The tier lends each stored stripe as read-only layer values (:class:`ViewSource`); the load copies the chunks' rows
from them into the destination blocks with one batched index copy per (layer, plane, stripe). Stripes lent whole
are verified against their per-layer checksums on the worker's verifier thread while the copies run, and partial
ones chunk by chunk before anything is copied; a chunk whose check fails is dropped (forgotten where it is stored)
and fails from there on. :class:`LentViews` is one load job's view path
(:class:`~range_connector.worker.loads.LoadJob` owns it; it reads and sets the job's plan and failures).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import torch
import xxhash

from range_connector.errors import BackendError
from range_connector.kv.metadata import ChunkTransfer, RequestTransfer
from range_connector.kv.stripes import Segment
from range_connector.kv.tickets import Ticket

logger = logging.getLogger("vllm.range_connector.worker.loads")


def row_selector(src_rows: list[int]) -> slice | torch.Tensor:
    """A slice when ``src_rows`` is one ascending run of consecutive rows (no gather needed), else an index."""
    first = src_rows[0]
    if src_rows == list(range(first, first + len(src_rows))):
        return slice(first, first + len(src_rows))
    return torch.tensor(src_rows, dtype=torch.long)


class ViewSource:
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


class LentViews:
    """One load job's lent stripes and the copies out of them.

    Args:
        job: the :class:`~range_connector.worker.loads.LoadJob` that owns this path (typed loosely: this module
            must not import the job's, which imports it).

    Attributes:
        sources: ``(shard_idx, stripe_id) -> `` the lent stripe.
        copies: per lent stripe (its :attr:`ViewSource.group`): ``(source rows, destination block ids)``, the same
            in every layer.
        pending_whole: ``(shard_idx, stripe_id) -> `` the verifier thread's whole-stripe check.
    """

    def __init__(self, job: Any) -> None:
        self.job = job
        self.sources: dict[tuple[int, str], ViewSource] = {}
        self.copies: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        self.pending_whole: dict[tuple[int, str], Future] = {}

    def start(self) -> None:
        """Borrow read-only views of the stored stripes (one call per shard): no staging copy. Stripes lent whole
        are verified against their per-layer checksums in a helper thread while the copies run; partial ones
        chunk by chunk, here."""
        job = self.job
        w = job.w
        by_shard: dict[int, list[Segment]] = defaultdict(list)
        for seg in job.segments:
            by_shard[seg.shard_idx].append(seg)
        for s, segs in by_shard.items():
            try:
                if time.monotonic() > job.deadline:
                    raise BackendError("the load deadline passed")
                lent = w.backends[s].view_stripes([seg.ticket.stripe_id for seg in segs])
            except (BackendError, ValueError) as exc:  # transient: the chunks fail, their tickets stay
                logger.warning("Range load from shard %d: %s", s, exc)
                w.stats.add("load_backend_errors")
                job.reads.errored.update((s, seg.ticket.stripe_id) for seg in segs)
                continue
            for seg, layers in zip(segs, lent):
                key, t = (s, seg.ticket.stripe_id), seg.ticket
                if layers is None or len(layers) != job.num_layers or any(v.nbytes != t.layer_bytes for v in layers):
                    job.reads.missing.add(key)
                    continue
                source = ViewSource(len(self.sources), t, layers, w.layout.row_dtype)
                source.whole = bool(t.stripe_checksums) and seg.first_block == 0 and seg.num_blocks == t.stripe_blocks
                self.sources[key] = source
        now = time.monotonic()
        job.layer_ready_s = [now] * job.num_layers
        verify = w.config.verify_checksums
        self.pending_whole = {key: w.verifier.submit(src.check_whole) for key, src in self.sources.items()
                               if verify and src.whole}
        # Copies per lent stripe: (source rows, destination block ids), the same in every layer.
        self.copies = defaultdict(lambda: ([], []))
        job._plan = []
        for req in job.reqs:
            for chunk in req.chunks:
                if not job._alive(req, chunk) or not job._chunk_present(req, chunk):
                    continue
                if verify and not all(self.pending_whole.get((s, t.stripe_id)) is not None
                                      or self.sources[(s, t.stripe_id)].check_chunk(t)
                                      for s, t in enumerate(chunk.tickets)):
                    w.stats.add("load_integrity_errors")
                    self.drop_bad(req, chunk)
                    continue
                dst_ids = []
                for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
                    s, slot = w.plan.shard_of_block(pos)
                    t = chunk.tickets[s]
                    src, dst = self.copies[self.sources[(s, t.stripe_id)].group]
                    src.append(t.block_offset + slot)
                    dst.append(block_id)
                    dst_ids.append(block_id)
                job._plan.append((req, chunk, dst_ids))

    def drop_bad(self, req: RequestTransfer, chunk: ChunkTransfer) -> None:
        """Fail a chunk whose bytes are corrupt on some shard and forget it on the shards where it is."""
        job = self.job
        for s, t in enumerate(chunk.tickets):
            source = self.sources.get((s, t.stripe_id))
            if source is not None and not source.check_chunk(t):
                job.w.drop(chunk.chunk_hash, s)
        job._fail(req.req_id, chunk.chunk_idx)

    def deliver(self, g: int) -> None:
        """Copy layer group ``g`` of every lent stripe into the destination blocks (one batched copy per layer,
        plane and stripe), unless the deadline passed."""
        job = self.job
        if time.monotonic() > job.deadline:
            job._give_up(g, "the load deadline passed")
            return
        group_source = {src.group: src for src in self.sources.values()}
        with job.lock:
            if job.closed:
                return
            for group_idx, (src_rows, dst_ids) in self.copies.items():
                source = group_source[group_idx]
                dst = job.w.device.index(dst_ids, job.w.kv_rows(0, 0))
                src = row_selector(src_rows)
                for layer_idx in job.groups[g]:
                    for p in range(job.num_planes):
                        job._copy(layer_idx, p, dst, source.tensors[layer_idx][p], src)
                job.w.stats.add("copy_launches", len(job.groups[g]) * job.num_planes)

    def settle(self) -> None:
        """At the end of the job: chunks of stripes whose whole-stripe check failed are checked alone, and the bad
        ones dropped (their blocks were already copied: the job reports them failed, so vLLM recomputes them)."""
        job = self.job
        bad = {key for key, fut in self.pending_whole.items() if not fut.result()}
        for req, chunk, _dst in job._plan:
            if job._alive(req, chunk) and any((s, t.stripe_id) in bad and not self.sources[(s, t.stripe_id)]
                                              .check_chunk(t) for s, t in enumerate(chunk.tickets)):
                job.w.stats.add("load_integrity_errors")
                self.drop_bad(req, chunk)
