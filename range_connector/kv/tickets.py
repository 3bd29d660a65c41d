"""Tickets: small metadata records that map a chunk of the prefix hash chain to physical extents in a stripe.

One ticket per (chunk, shard, head slice): which stripe holds the shard's slice of the chunk for the KV heads one
tensor-parallel rank holds, where inside it, and the checksum of those bytes in every layer. A ticket is published
under one key per head it covers (:func:`ticket_key`), so that the keys do not depend on the writer's
tensor-parallel size (:mod:`range_connector.kv.heads`). Lookup reads the tickets of a whole prompt in one
batched request per shard (``MGET`` on Valkey: one command whatever the number of chunks); loads then read byte
ranges of stripes, never one object per chunk. Tickets are msgpack (never pickle) and are checked against the registered
layout before use: a ticket that does not fit is a miss (docs/architecture.md, principle 6).

Tickets come from storage, so they are untrusted: every field is type-checked, and the geometry is bounded *above*
before anything is sized from it. Layers, blocks per chunk and bytes per block are those of the registered layout;
a stripe's layer value (``num_planes * stripe_blocks * row_bytes``) is at most ``max_layer_bytes`` (the tier's
value limit: no writer could have stored a larger one), and heads are below :data:`MAX_HEADS`. So a poisoned ticket
(billions of blocks, a stripe of petabytes) is a miss, never an allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from range_connector.kv.namespace import ChunkHash

TICKET_VERSION = 2
#: upper bound on ``head_start + num_heads`` of a ticket (no model has this many KV heads)
MAX_HEADS = 1 << 16
#: default bound on a ticket's layer value, bytes, where the caller does not give the tier's limit (the DRAM tier's
#: default value limit)
MAX_LAYER_BYTES = 2 << 30


def ticket_key(chunk_hash: ChunkHash, shard_idx: int, head: int = 0) -> bytes:
    """Key of the ticket that covers KV head ``head`` of one shard's slice of one chunk: ``t:<chunk>:s<s>:h<head>``,
    within the deployment (each tier puts it under its deployment: on Valkey ``rc3:<deployment>:t:...``)."""
    return b"t:%s:s%d:h%d" % (chunk_hash.hex().encode(), shard_idx, head)


def key_chunk_hash(key: bytes) -> ChunkHash | None:
    """The chunk hash a :func:`ticket_key` names (``None``: not a ticket key)."""
    parts = key.split(b":")
    try:
        return ChunkHash(bytes.fromhex(parts[1].decode())) if len(parts) == 4 and parts[0] == b"t" else None
    except ValueError:
        return None


def key_shard(key: bytes) -> int | None:
    """The shard index a :func:`ticket_key` names (``None``: not a ticket key)."""
    parts = key.split(b":")
    if len(parts) != 4 or parts[0] != b"t" or not parts[2].startswith(b"s") or not parts[2][1:].isdigit():
        return None
    return int(parts[2][1:])


def head_keys(chunk_hash: ChunkHash, shard_idx: int, heads: range) -> list[bytes]:
    """Keys a ticket covering ``heads`` is published under (one per head: :func:`ticket_key`)."""
    return [ticket_key(chunk_hash, shard_idx, h) for h in heads]


@dataclass(frozen=True, slots=True)
class Ticket:
    """Where one shard's slice of one chunk lives.

    A stripe stores, for every layer, one value ``[num_planes, stripe_blocks, row_bytes]``; this chunk's blocks are
    ``[block_offset, block_offset + num_blocks)`` of every plane.

    Attributes:
        stripe_id: the stripe (hex string, unique per save batch and shard).
        block_offset: first block of the chunk inside the stripe.
        num_blocks: blocks of the chunk held by this shard.
        stripe_blocks: blocks in the stripe (the per-plane stride is ``stripe_blocks * row_bytes`` bytes).
        num_layers: layers in the stripe.
        num_planes: planes per layer.
        row_bytes: bytes of one block of one plane of one layer.
        checksums: ``[num_layers]`` xxh3-64 of this chunk's bytes in each layer (planes in order).
        stripe_checksums: ``[num_layers]`` xxh3-64 of each whole layer value of the stripe (empty if unknown): a
            load that reads the whole stripe verifies it once per layer instead of once per chunk and layer.
        head_start: first KV head (of the model's) the bytes cover.
        num_heads: KV heads the bytes cover (a row is those heads of one block of one plane of one layer).
    """

    stripe_id: str
    block_offset: int
    num_blocks: int
    stripe_blocks: int
    num_layers: int
    num_planes: int
    row_bytes: int
    checksums: tuple[int, ...]
    stripe_checksums: tuple[int, ...] = ()
    head_start: int = 0
    num_heads: int = 1

    @property
    def layer_bytes(self) -> int:
        """Bytes of the stripe's value for one layer."""
        return self.num_planes * self.stripe_blocks * self.row_bytes

    def plane_range(self, plane_idx: int) -> tuple[int, int]:
        """``(offset, length)`` in bytes of this chunk's blocks of one plane inside a layer value."""
        offset = (plane_idx * self.stripe_blocks + self.block_offset) * self.row_bytes
        return offset, self.num_blocks * self.row_bytes

    def encode(self) -> bytes:
        """msgpack bytes."""
        fields = [TICKET_VERSION, self.stripe_id, self.block_offset, self.num_blocks, self.stripe_blocks,
                  self.num_layers, self.num_planes, self.row_bytes, list(self.checksums), self.head_start,
                  self.num_heads, list(self.stripe_checksums)]
        return msgpack.packb(fields)

    @classmethod
    def decode(cls, raw: bytes | None, *, num_layers: int, layer_block_bytes: int, num_blocks: int,
               heads: tuple[int, int] = (0, 1), max_layer_bytes: int = MAX_LAYER_BYTES) -> Ticket | None:
        """Parse and bounds-check a ticket read from a tier, for a reader that holds exactly its heads.

        Args:
            raw: the bytes, or ``None`` for a miss.
            num_layers: layers of the registered layout.
            layer_block_bytes: bytes of one block of one layer (all planes) of the reader's heads, as registered.
            num_blocks: blocks of a chunk on one shard.
            heads: ``(head_start, num_heads)`` the reader holds: a ticket for other heads is a miss.
            max_layer_bytes: the largest layer value the tier holds (``Backend.max_value_bytes``): a ticket whose
                stripe's layer value is larger is a miss.

        Returns:
            The ticket, or ``None`` if it is missing, malformed or does not match the layout (never raises).
        """
        t = cls._parse(raw, num_layers=num_layers, num_blocks=num_blocks, max_layer_bytes=max_layer_bytes)
        if t is None or t.num_planes * t.row_bytes != layer_block_bytes or (t.head_start, t.num_heads) != heads:
            return None
        return t

    @classmethod
    def decode_covering(cls, raw: bytes | None, *, num_layers: int, head_block_bytes: int, num_blocks: int,
                        head: int, max_layer_bytes: int = MAX_LAYER_BYTES) -> Ticket | None:
        """Parse and bounds-check a ticket read under KV head ``head``'s key, whatever heads its writer held.

        Args:
            raw: the bytes, or ``None`` for a miss.
            num_layers: layers of the registered layout.
            head_block_bytes: bytes of one block of one layer (all planes) of one KV head.
            num_blocks: blocks of a chunk on one shard.
            head: the head whose key it was read under: the ticket must cover it.
            max_layer_bytes: as for :meth:`decode`.

        Returns:
            The ticket, or ``None`` if it is missing, malformed, does not cover ``head`` or its rows are not its
            heads' bytes (never raises).
        """
        t = cls._parse(raw, num_layers=num_layers, num_blocks=num_blocks, max_layer_bytes=max_layer_bytes)
        if t is None or not t.head_start <= head < t.head_start + t.num_heads:
            return None
        if t.num_planes * t.row_bytes != t.num_heads * head_block_bytes or t.row_bytes % t.num_heads:
            return None
        return t

    @classmethod
    def decode_object(cls, raw: bytes | None, *, max_layer_bytes: int = MAX_LAYER_BYTES) -> Ticket | None:
        """Parse and bounds-check the ticket of one opaque object of any size (an LMCache object,
        :mod:`range_connector.lmcache`): one layer, one plane, one-byte rows, so ``block_offset`` and ``num_blocks``
        are the object's byte offset and length in its stripe's value of ``stripe_blocks`` bytes.

        Returns:
            The ticket, or ``None`` if it is missing, malformed or not an object's ticket (never raises).
        """
        t = cls._parse(raw, num_layers=1, num_blocks=None, max_layer_bytes=max_layer_bytes)
        if t is None or (t.num_planes, t.row_bytes, t.head_start, t.num_heads) != (1, 1, 0, 1):
            return None
        return t

    @classmethod
    def _parse(cls, raw: bytes | None, *, num_layers: int, num_blocks: int | None,
               max_layer_bytes: int) -> Ticket | None:
        if raw is None:
            return None
        try:
            v = msgpack.unpackb(raw, use_list=True, strict_map_key=True)
            if not isinstance(v, list) or len(v) != 12 or v[0] != TICKET_VERSION:
                return None
            _, stripe_id, block_offset, nb, stripe_blocks, nl, npl, rb, checksums, h0, nh, stripe_sums = v
            ints = (block_offset, nb, stripe_blocks, nl, npl, rb, h0, nh)
            if not isinstance(stripe_id, str) or not all(type(x) is int for x in ints):
                return None
            if nl != num_layers or (nb < 1 if num_blocks is None else nb != num_blocks):
                return None
            if npl < 1 or rb < 1 or h0 < 0 or not 1 <= nh <= MAX_HEADS - h0:
                return None
            if block_offset < 0 or stripe_blocks <= 0 or block_offset + nb > stripe_blocks:
                return None
            if npl * stripe_blocks * rb > max_layer_bytes:  # (bounded before anything is sized from it)
                return None
            for sums in (checksums, stripe_sums):
                if sums is stripe_sums and not sums:
                    continue
                if (not isinstance(sums, list) or len(sums) != nl
                        or not all(type(c) is int and 0 <= c < 1 << 64 for c in sums)):
                    return None
            if not stripe_id or len(stripe_id) > 64 or not stripe_id.isalnum():
                return None
            return cls(stripe_id, block_offset, nb, stripe_blocks, nl, npl, rb, tuple(checksums), tuple(stripe_sums),
                       h0, nh)
        except (ValueError, TypeError, msgpack.UnpackException):
            return None
