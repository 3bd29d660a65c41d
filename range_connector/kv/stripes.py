"""Byte stripes: how a save batch is laid out on a tier, and how a load turns tickets into ranged reads.

A save batch (one engine step's new full chunks, all requests together) becomes, per shard, one stripe: for every
layer a value ``[num_planes, stripe_blocks, row_bytes]`` holding that shard's blocks of every chunk of the batch, in
chunk order. One layer of one batch is therefore one contiguous byte range (a whole value on Valkey), whatever the
chunk size, and a chunk is read back out of a stripe by byte range. A batch larger than the tier's value limit is
split into several stripes at chunk boundaries.

Reads are planned per (shard, stripe, layer, plane) as the smallest byte span covering the wanted chunks, so the
number of reads and copies follows stripes and layers, not chunks (docs/architecture.md, principle 1).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from range_connector.kv.layout import KVLayout
from range_connector.kv.tickets import Ticket


def new_stripe_id() -> str:
    """A fresh stripe id (32 hex characters)."""
    return uuid.uuid4().hex


def chunk_groups(num_chunks: int, blocks_per_chunk_shard: int, layer_block_bytes: int,
                 max_value_bytes: int) -> list[range]:
    """Split ``num_chunks`` chunks into stripes whose layer values stay within ``max_value_bytes``.

    Raises:
        ValueError: one chunk alone is over the limit.
    """
    per_chunk = blocks_per_chunk_shard * layer_block_bytes
    if per_chunk > max_value_bytes:
        raise ValueError(f"one chunk's layer value is {per_chunk} bytes, over the tier's limit of {max_value_bytes}")
    per_stripe = max(1, max_value_bytes // per_chunk)
    return [range(i, min(num_chunks, i + per_stripe)) for i in range(0, num_chunks, per_stripe)]


def gather_layer(rows: Sequence[torch.Tensor], layout: KVLayout, layer_idx: int, index: torch.Tensor) -> torch.Tensor:
    """Gather blocks of one layer into a new contiguous ``[num_planes, n, row_elems]`` tensor.

    One index copy per plane. ``rows`` are the row views of :func:`range_connector.kv.layout.block_rows`.
    """
    planes = [rows[layer_idx * layout.num_planes + p].index_select(0, index) for p in range(layout.num_planes)]
    return planes[0].unsqueeze(0) if len(planes) == 1 else torch.stack(planes)


def chunk_checksum(value: memoryview, num_planes: int, stripe_blocks: int, block_offset: int, num_blocks: int,
                   row_bytes: int) -> int:
    """xxh3-64 of one chunk's bytes inside one layer value (its planes in order)."""
    h = xxhash.xxh3_64()
    for p in range(num_planes):
        start = (p * stripe_blocks + block_offset) * row_bytes
        h.update(value[start:start + num_blocks * row_bytes])
    return h.intdigest()


@dataclass
class Segment:
    """One contiguous span of blocks read from one stripe of one shard (same span in every layer and plane).

    Attributes:
        shard_idx: the shard.
        ticket: a ticket of the stripe (for its geometry).
        first_block: first block of the span inside the stripe.
        num_blocks: blocks in the span.
        bank_row: row of the span's first block in each (layer, plane) region of the bank.
    """

    shard_idx: int
    ticket: Ticket
    first_block: int
    num_blocks: int
    bank_row: int = 0


def plan_segments(wanted: dict[tuple[int, str], list[Ticket]]) -> list[Segment]:
    """Cover the wanted chunks of each (shard, stripe) with one span of blocks.

    Args:
        wanted: ``{(shard_idx, stripe_id): [tickets of the chunks to read]}``.

    Returns:
        Segments, with ``bank_row`` assigned consecutively (every (layer, plane) region of the bank holds the
        segments in this order).
    """
    segments = []
    row = 0
    for (shard_idx, _stripe_id), tickets in wanted.items():
        first = min(t.block_offset for t in tickets)
        end = max(t.block_offset + t.num_blocks for t in tickets)
        segments.append(Segment(shard_idx, tickets[0], first, end - first, row))
        row += end - first
    return segments
