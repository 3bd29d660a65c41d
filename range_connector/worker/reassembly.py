"""Loads of KV stored by writers of other head slices: a consumer of another tensor-parallel size (worker side).

A rank that holds KV heads ``[c0, c1)`` may find a chunk stored as *pieces*: tickets of writers that held other
head slices (a prefill engine at TP 2 for a decode engine at TP 1 finds two pieces of one head each; the reverse
finds one piece of two heads, of which it needs one). A row of one (layer, plane, block) is
``[head_runs, num_heads, head bytes]`` (:attr:`~range_connector.kv.layout.KVLayout.head_runs`; on CPU dense
attention heads are outermost, so a head's bytes are contiguous), and the KV of a head does not depend on how many
heads a rank holds, so a rank's row is assembled from the pieces' rows head by head.

:func:`reassemble` reads every piece of the requests' chunks (one batched ranged read per shard), checks each
piece's checksum in every layer, and copies each of the rank's heads from the piece that covers it. It runs
synchronously, before the forward (these loads are neither layer-pipelined nor asynchronous). A chunk whose piece is
missing, corrupt or unreadable fails from there on, like any load (its blocks are reported and recomputed).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import xxhash

from range_connector.backends.base import RangeRead
from range_connector.kv.metadata import ChunkTransfer, RequestTransfer
from range_connector.kv.namespace import ChunkHash
from range_connector.kv.tickets import MAX_LAYER_BYTES, Ticket
from range_connector.worker.shard_reads import ShardReads

if TYPE_CHECKING:
    from range_connector.worker.context import LoadContext

logger = logging.getLogger("vllm." + __name__)


def has_pieces(req: RequestTransfer) -> bool:
    """Whether any chunk of the load is stored as pieces of other head slices."""
    return any(isinstance(entry, tuple) for c in req.chunks for entry in c.tickets)


def _pieces(entry: Ticket | tuple[Ticket, ...]) -> tuple[Ticket, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


def reassemble(context: LoadContext, reqs: list[RequestTransfer], deadline: float
               ) -> tuple[dict[str, int], list[tuple[ChunkHash, list[int], list[int]]]]:
    """Load ``reqs`` from pieces into this rank's KV cache.

    Args:
        context: the worker's KV rows, layout, heads, plan and backends.
        reqs: loads cut to this rank's ticket group, ``[num_shards]`` entries per chunk (a ticket or pieces).
        deadline: ``time.monotonic()`` after which nothing more is read (those chunks fail).

    Returns:
        ``(failed_from, done)``: ``req_id -> chunk_idx`` from which each failed request's load failed, and
        ``(chunk hash, shards, block ids written)`` of every chunk that landed whole. Never raises for a tier
        failure or a bad ticket.
    """
    layout, plan = context.layout, context.plan
    c0, my_heads = context.heads
    failed_from: dict[str, int] = {}
    head_bytes = layout.row_bytes // max(1, layout.num_heads)
    runs = layout.head_runs
    num_layers, num_planes = len(context.layer_names), layout.num_planes

    max_stripe_blocks = context.max_stripe_blocks

    def fits(t: Ticket) -> bool:  # (bounded like any ticket before its piece buffer is sized from it)
        return (isinstance(t, Ticket) and runs > 0 and t.num_layers == num_layers and t.num_planes == num_planes
                and t.num_blocks == plan.blocks_per_shard and t.row_bytes == t.num_heads * head_bytes
                and 0 <= t.block_offset and t.block_offset + t.num_blocks <= t.stripe_blocks <= max_stripe_blocks
                and t.layer_bytes <= MAX_LAYER_BYTES)

    # Plan: for every live chunk, per shard, which piece gives each of this rank's heads.
    planned: list[tuple[RequestTransfer, ChunkTransfer, list[list[Ticket]]]] = []
    for req in reqs:
        if req.fail or not req.chunks:
            if req.chunks:
                failed_from[req.req_id] = req.chunks[0].chunk_idx
            continue
        for chunk in req.chunks:
            by_head = []
            for entry in chunk.tickets:
                pieces = _pieces(entry)
                sources = [next((t for t in pieces if t.head_start <= h < t.head_start + t.num_heads), None)
                           for h in range(c0, c0 + my_heads)]
                by_head.append(sources)
            if len(by_head) != plan.num_shards or any(t is None or not fits(t) for src in by_head for t in src):
                failed_from[req.req_id] = chunk.chunk_idx
                break
            planned.append((req, chunk, by_head))  # type: ignore[arg-type]
    if runs == 0 and reqs:
        logger.warning("Range: this KV layout cannot be split by head; loads stored by another tensor-parallel "
                       "size are recomputed")

    # One buffer per (chunk, shard, piece): [num_layers][num_planes][num_blocks * row_bytes], read in one batch
    # per shard.
    reads: dict[int, list[RangeRead]] = defaultdict(list)
    buffers: dict[tuple[int, int, str, int], torch.Tensor] = {}
    for n, (_req, _chunk, by_head) in enumerate(planned):
        for s, sources in enumerate(by_head):
            for t in {(t.stripe_id, t.block_offset): t for t in sources}.values():
                piece_bytes = t.num_blocks * t.row_bytes
                buf = torch.empty(num_layers * num_planes * piece_bytes, dtype=torch.uint8)
                buffers[(n, s, t.stripe_id, t.block_offset)] = buf
                mv = memoryview(buf.numpy()).cast("B")
                for layer_idx in range(num_layers):
                    for p in range(num_planes):
                        start = (layer_idx * num_planes + p) * piece_bytes
                        reads[s].append(RangeRead(t.stripe_id, layer_idx,
                                                  (p * t.stripe_blocks + t.block_offset) * t.row_bytes, piece_bytes,
                                                  t.layer_bytes, mv[start:start + piece_bytes]))
    shard_reads = ShardReads(context.backends, context.stats)
    never_cancelled = threading.Event()
    for s, batch in reads.items():
        shard_reads.read(s, batch, cancelled=never_cancelled, deadline=deadline)

    done = []
    for n, (req, chunk, by_head) in enumerate(planned):
        if chunk.chunk_idx >= failed_from.get(req.req_id, 1 << 62):
            continue
        ok = True
        for s, sources in enumerate(by_head):
            for t in {(t.stripe_id, t.block_offset): t for t in sources}.values():
                if (s, t.stripe_id) in shard_reads.missing:
                    context.drop(chunk.chunk_hash, s)
                    ok = False
                elif (s, t.stripe_id) in shard_reads.errored:
                    ok = False
                elif context.config.verify_checksums and not _piece_ok(buffers[(n, s, t.stripe_id, t.block_offset)],
                                                                       t, num_layers, num_planes):
                    logger.warning("Range load: checksum mismatch in piece of stripe %s (heads %d-%d)", t.stripe_id,
                                   t.head_start, t.head_start + t.num_heads - 1)
                    context.stats.add("load_integrity_errors")
                    context.drop(chunk.chunk_hash, s)
                    ok = False
        if not ok:
            failed_from[req.req_id] = chunk.chunk_idx
            continue
        written = _copy_chunk(context, chunk, by_head, buffers, n, c0, my_heads, head_bytes)
        done.append((chunk.chunk_hash, list(range(len(chunk.tickets))), written))
    context.stats.add("reassembled_chunks", len(done))
    return failed_from, done


def _piece_ok(buf: torch.Tensor, t: Ticket, num_layers: int, num_planes: int) -> bool:
    layer_bytes = num_planes * t.num_blocks * t.row_bytes
    mv = memoryview(buf.numpy()).cast("B")
    return all(xxhash.xxh3_64_intdigest(mv[i * layer_bytes:(i + 1) * layer_bytes]) == t.checksums[i]
               for i in range(num_layers))


def _copy_chunk(context: LoadContext, chunk: ChunkTransfer, by_head: list[list[Ticket]],
                buffers: dict[tuple[int, int, str, int], torch.Tensor], n: int, c0: int, my_heads: int,
                head_bytes: int) -> list[int]:
    """Copy each of the rank's heads of the chunk's blocks from the piece that holds it; returns the block ids."""
    layout, plan = context.layout, context.plan
    runs = layout.head_runs
    inner = head_bytes // runs
    num_layers, num_planes = len(context.layer_names), layout.num_planes
    written = []
    # group the chunk's blocks by shard: (slots in the shard's rows, destination block ids)
    per_shard: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for pos, block_id in zip(chunk.block_positions, chunk.block_ids):
        s, slot = plan.shard_of_block(pos)
        per_shard[s][0].append(slot)
        per_shard[s][1].append(block_id)
        written.append(block_id)
    for s, (slots, dst_ids) in per_shard.items():
        src_idx = torch.tensor(slots, dtype=torch.long)
        dst_idx = torch.tensor(dst_ids, dtype=torch.long)
        for h, t in enumerate(by_head[s]):  # h: this rank's head index; t: the piece holding it
            buf = buffers[(n, s, t.stripe_id, t.block_offset)]
            k = c0 + h - t.head_start  # the head's place in the piece's rows
            piece = buf.view(num_layers, num_planes, t.num_blocks, runs, t.num_heads, inner)
            for layer_idx in range(num_layers):
                for p in range(num_planes):
                    dst = context.kv_rows(layer_idx, p).view(torch.uint8).view(layout.num_blocks, runs, my_heads,
                                                                                inner)
                    dst[dst_idx, :, h] = piece[layer_idx, p].index_select(0, src_idx)[:, :, k]
    return written
