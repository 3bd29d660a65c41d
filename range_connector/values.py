"""Byte format of one stored value: a fixed header, then the payload.

``header = magic "RCV1" | u32 num_row_groups | u64 payload_bytes | u64 xxh3_64(payload)`` (little-endian, 24 bytes).
The payload is ``[num_row_groups, num_blocks, row_bytes]``: for every (layer, plane), the rows of the value's blocks
in stored order. Nothing read from a tier is trusted: size, header and checksum are checked before the bytes reach
the KV cache (DESIGN.md §3.6); xxh3 is the fast non-cryptographic checksum measured there.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from range_connector.errors import IntegrityError

_HEADER = struct.Struct("<4sIQQ")
MAGIC = b"RCV1"
HEADER_BYTES = _HEADER.size


def encode_value(payload: memoryview | bytes, num_row_groups: int) -> bytes:
    """Prefix a payload with its header (one allocation: header + payload).

    Args:
        payload: ``[num_row_groups, num_blocks, row_bytes]`` bytes, contiguous.
        num_row_groups: layers x planes.
    """
    view = memoryview(payload).cast("B")
    out = bytearray(HEADER_BYTES + view.nbytes)
    out[HEADER_BYTES:] = view
    checksum = xxhash.xxh3_64_intdigest(view)
    _HEADER.pack_into(out, 0, MAGIC, num_row_groups, view.nbytes, checksum)
    return bytes(out)


def decode_value(value: bytes, *, num_row_groups: int, payload_bytes: int, verify: bool, where: str) -> np.ndarray:
    """Check a value read from a tier and return its payload as a read-only ``uint8`` array.

    Args:
        value: the bytes as read.
        num_row_groups: expected layers x planes.
        payload_bytes: expected payload size in bytes.
        verify: compute and compare the checksum (always checks the header and sizes).
        where: tier and key, for error messages.

    Raises:
        IntegrityError: wrong size, bad header or checksum mismatch.
    """
    if len(value) != HEADER_BYTES + payload_bytes:
        raise IntegrityError(f"{where}: value is {len(value)} bytes, expected {HEADER_BYTES + payload_bytes}")
    magic, groups, size, checksum = _HEADER.unpack_from(value, 0)
    if magic != MAGIC or groups != num_row_groups or size != payload_bytes:
        raise IntegrityError(f"{where}: header {magic!r}/{groups}/{size} does not match the registered layout")
    payload = memoryview(value)[HEADER_BYTES:]
    if verify and xxhash.xxh3_64_intdigest(payload) != checksum:
        raise IntegrityError(f"{where}: checksum mismatch over bytes [{HEADER_BYTES}, {len(value)})")
    return np.frombuffer(payload, dtype=np.uint8)
