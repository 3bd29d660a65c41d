"""Direct receive: on CPU, the stripe rows a load reads land straight in the destination KV blocks.

The bank path (:mod:`range_connector.worker.banks`) receives every byte into a staging bank, then copies it into the KV
cache with one index copy per (layer, plane). When the KV cache is host memory and the tier can write into caller
buffers (``Backend.supports_scatter``: the Valkey tier's RESP reader, the file tier's ``preadv``; the DRAM tier too,
though its loads borrow views of its stripes instead), the staging copy is pure cost: each read's destination is
instead a :class:`~range_connector.backends.base.ScatterDest` over the KV rows the bytes belong in (consecutive
destination blocks merged into one piece), so the payload is moved once, by the socket receive (or ``preadv``)
itself. A whole-stripe read is also checksummed by the tier as its bytes land (``digest``: read back
from the rows just received, while they are in cache), instead of in a second pass over the KV rows.

Rows are numbered as in a bank region: segment ``seg`` (:class:`~range_connector.kv.stripes.Segment`) holds rows
``[seg.bank_row, seg.bank_row + seg.num_blocks)``, the same numbering in every (layer, plane). A row that no chunk
of the load has a destination for (a gap between the wanted chunks of a stripe, or a block of a partial chunk that
vLLM already holds) lands in a small spill tensor, so that every chunk can still be verified against its checksums
exactly as from a bank. A row wanted by two destinations (two requests of one load reading the same chunk) cannot
land twice: such loads keep the bank path.

A block that vLLM writes into during the same forward (``RequestTransfer.computed_block_ids``: a load that ends
inside a block, a stored tail, leaves vLLM its last token, and vLLM writes that token's KV of a layer before
attention asks Range for the layer) is not received in place either: its rows land in the spill tensor, are
verified there, and are copied into the block when their layer group is delivered (:meth:`DirectRows.land_deferred`).
Received in place, the block would be verified from the KV cache after vLLM had written its token into it, and fail
whenever vLLM's KV of that token differs in a bit from the stored one (a prefill engine computed it in another
batch): found as 18-19 checksum mismatches per ``make demo`` run on a non-AMX CPU, every one in the first layer of
a group (the layer whose KV vLLM had written when the group was verified).

The destination blocks belong to the request being loaded, so bytes land there before they are verified; a chunk
that fails its checksum fails as on the bank path (its blocks are reported and vLLM recomputes them), and a layer is
handed to attention only after its group landed and was verified (:mod:`range_connector.worker.loads`). The gate of
every ``ScatterDest`` is the load job's: once the job is cancelled (aborted request, passed deadline) nothing more is
written. CUDA KV caches keep the bank path (pinned staging, copy stream).

Why (measured on the 2-core development machine on 29 November 2026, restoring 512 MiB of the granularity bench's KV,
32 layers of 16 MiB, from one loopback Valkey server; other sessions kept 0.3-1.3 cores busy, so single runs vary by
+-40% and variants were compared in one process, alternated restore by restore, 9-21 rounds):

* Where the time went on the bank path (``bench/granularity.py``'s instrumented round): the reader thread's
  receive 0.19-0.24 s, the consumer's checksum pass 0.03 s and its bank -> KV index copies 0.06 s, on the
  consumer thread beside the receive; but the reader, the consumer and the server share 2 cores, so the copy and the
  second pass over the bytes lengthened the receive instead of hiding behind it. One loopback TCP connection moves
  512 MiB in 0.11-0.12 s with the machine idle (0.19-0.22 s with other work): the client's receive alone is
  0.13-0.14 CPU-s, the server's send about 0.075 CPU-s.
* CPU per restore (this process, all threads, timed part only): bank 0.215-0.220 s, direct receive with the
  checksum pass over the rows 0.173-0.182 s, direct receive checksummed as the bytes land 0.146-0.180 s (the server
  0.06-0.085 s in each). Median restore in one run at load average 2.3-2.6: 0.22-0.23 s bank, 0.19-0.20 s direct,
  0.15-0.17 s direct checksummed as bytes land; paired ratios to the bank path over five runs at load average 1.8-10:
  0.79-0.90 direct, 0.72-0.87 checksummed as bytes land. Time to the first layer: 0.05-0.07 s -> 0.03 s.
* The file tier (page cache warm, 21 rounds at load average 1.5-2.8): bank 0.116-0.131 s, direct receive with the
  checksum pass over the rows 0.083-0.084 s, checksummed as the bytes land 0.067-0.071 s (0.57x; ``preadv`` of
  1 MiB per call: see ``range_connector/backends/file/stripes.py``); the resident copy of the same bytes takes 0.062 s.
* Rejected: spreading a read over 2 or 3 connections read by as many threads (0.91-1.03 of one connection, within
  the noise: the server and the other work already hold the second core); Valkey ``io-threads`` 2 or 3 (2-5x slower
  here: the I/O threads spin on 2 cores; it would also have to apply to every path of the benchmark); a unix socket
  (raw sockets moved 512 MiB in 0.13 s against 0.19 s over loopback TCP, but the baselines connect over TCP);
  capping the receive's scatter list (1024, 128, 32 or 8 pieces per call: no difference; receives average about
  1 MiB, 418 calls per 512 MiB).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch
import xxhash

from range_connector.backends.base import RangeRead, ScatterDest
from range_connector.errors import BackendError
from range_connector.kv.stripes import Segment

logger = logging.getLogger("vllm." + __name__)


class WriteGate:
    """The gate of one load job's direct receives (``ScatterDest.gate``): entered while bytes move into the KV cache
    (by several shards' readers at once), refusing with :class:`BackendError` once closed; :meth:`close` returns
    when no write is in progress."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._cond:
            if self._closed:
                raise BackendError("the load was cancelled: nothing more is written into its blocks")
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse every later write and wait for those in progress (each a non-blocking receive or a copy)."""
        with self._cond:
            self._closed = True
            if not self._cond.wait_for(lambda: not self._active, timeout=timeout_s):
                logger.error("Range load: a receive into the KV cache did not end within %.0f s", timeout_s)


class DirectRows:
    """Where every row of a load's segments lands: a KV block, or a row of the spill tensor.

    A whole-stripe read is checksummed by the tier as its bytes land (``ScatterDest.digest``,
    :attr:`hash_on_receive`); other spans are checksummed from their rows when verified.

    Args:
        kv_rows: ``kv_rows(layer_idx, plane_idx)`` -> the ``[num_blocks, row_elems]`` row view of the KV cache.
        num_layers: layers of the registered layout.
        num_planes: planes per layer.
        row_bytes: bytes of one (layer, plane, block) row.
        segments: the load's segments (``bank_row`` numbering their rows consecutively).
        dst_of_row: ``[num_rows]`` destination block id of each row, ``None`` for rows without one.
        deferred: ``{row: block id}`` of rows that land in the spill tensor and are copied into that block once
            verified (:meth:`land_deferred`); their ``dst_of_row`` is ``None``.

    Attributes:
        num_spill_rows: rows that land in the spill tensor (per layer and plane).
        deferred: as the argument.
    """

    #: checksum whole-stripe reads as their bytes land (see the module docstring for why)
    hash_on_receive = True

    def __init__(self, kv_rows: Callable[[int, int], torch.Tensor], num_layers: int, num_planes: int,
                 row_bytes: int, segments: Sequence[Segment], dst_of_row: Sequence[int | None],
                 deferred: Mapping[int, int] | None = None) -> None:
        self.num_planes, self.row_bytes, self.segments = num_planes, row_bytes, segments
        self.deferred = dict(deferred or {})
        spill_of_row: dict[int, int] = {}
        for row, dst in enumerate(dst_of_row):
            if dst is None:
                spill_of_row[row] = len(spill_of_row)
        self.num_spill_rows = len(spill_of_row)
        self._spill_of_row = spill_of_row
        # Runs of rows that land contiguously: (first row, rows, in the KV cache?, first block id or spill row). A
        # run never crosses a segment boundary (each read covers one segment).
        bounds = {seg.bank_row for seg in segments}
        runs: list[tuple[int, int, bool, int]] = []
        for row, dst in enumerate(dst_of_row):
            in_kv, idx = (True, dst) if dst is not None else (False, spill_of_row[row])
            if runs and row not in bounds:
                first, count, kv, start = runs[-1]
                if kv == in_kv and start + count == idx:
                    runs[-1] = (first, count + 1, kv, start)
                    continue
            runs.append((row, 1, in_kv, idx))
        self._runs = runs
        self._run_starts = [r[0] for r in runs]
        self._kv = [[memoryview(kv_rows(layer, p).numpy()).cast("B") for p in range(num_planes)]
                    for layer in range(num_layers)]
        #: (segment's first row, layer) -> running xxh3 of a whole-stripe read, updated by the tier as bytes land
        self._digests: dict[tuple[int, int], object] = {}
        self._spill = None
        if self.num_spill_rows:
            spill = torch.empty((num_layers, num_planes, self.num_spill_rows * row_bytes), dtype=torch.uint8)
            self._spill = [[memoryview(spill[layer, p].numpy()) for p in range(num_planes)]
                           for layer in range(num_layers)]

    @classmethod
    def plan(cls, kv_rows: Callable[[int, int], torch.Tensor], num_layers: int, num_planes: int, row_bytes: int,
             segments: Sequence[Segment], num_rows: int, copies: Sequence[tuple[Sequence[int], Sequence[int]]],
             computed_block_ids: Collection[int] = ()) -> DirectRows | None:
        """Place every row, or return ``None`` when some row has two destinations (the load then uses banks).

        Args:
            kv_rows, num_layers, num_planes, row_bytes, segments: as for the constructor.
            num_rows: rows of all segments together.
            copies: ``(source rows, destination block ids)`` of every chunk, as the bank path would copy them.
            computed_block_ids: blocks vLLM writes into during the load's forward: their rows are staged and copied
                once verified (the constructor's ``deferred``), never received in place.
        """
        dst_of_row: list[int | None] = [None] * num_rows
        deferred: dict[int, int] = {}
        for src_rows, dst_ids in copies:
            for row, dst in zip(src_rows, dst_ids):
                if dst_of_row[row] is not None or row in deferred:
                    return None
                if dst in computed_block_ids:
                    deferred[row] = dst
                else:
                    dst_of_row[row] = dst
        return cls(kv_rows, num_layers, num_planes, row_bytes, segments, dst_of_row, deferred)

    def land_deferred(self, layers: range, rows: Iterable[int]) -> None:
        """Copy staged rows (keys of :attr:`deferred`, verified) of every plane of ``layers`` into their blocks.
        The caller holds the load job's lock (its blocks are still its own)."""
        rb = self.row_bytes
        for row in rows:
            block, spill_row = self.deferred[row], self._spill_of_row[row]
            for layer_idx in layers:
                for p in range(self.num_planes):
                    self._kv[layer_idx][p][block * rb:(block + 1) * rb] = \
                        self._spill[layer_idx][p][spill_row * rb:(spill_row + 1) * rb]  # type: ignore[index]

    def pieces(self, layer_idx: int, plane_idx: int, first_row: int, num_rows: int) -> list[memoryview]:
        """Byte views where rows ``[first_row, first_row + num_rows)`` of one (layer, plane) land, in row order."""
        out: list[memoryview] = []
        end = first_row + num_rows
        rb = self.row_bytes
        i = bisect.bisect_right(self._run_starts, first_row) - 1
        while i < len(self._runs) and self._runs[i][0] < end:
            first, count, in_kv, start = self._runs[i]
            lo, hi = max(first, first_row), min(first + count, end)
            base = self._kv[layer_idx][plane_idx] if in_kv else self._spill[layer_idx][plane_idx]  # type: ignore[index]
            out.append(base[(start + lo - first) * rb:(start + hi - first) * rb])
            i += 1
        return out

    def reads(self, layers: range, gate: contextlib.AbstractContextManager,
              checksums: bool = True) -> dict[int, list[RangeRead]]:
        """The reads of one layer group, per shard: a segment that is a whole stripe is one whole-value read per
        layer (its planes back to back, checksummed as it lands when ``checksums``), a partial one a ranged read per
        (layer, plane)."""
        by_shard: dict[int, list[RangeRead]] = defaultdict(list)
        rb, planes = self.row_bytes, self.num_planes
        for seg in self.segments:
            t = seg.ticket
            whole = seg.first_block == 0 and seg.num_blocks == t.stripe_blocks
            for layer_idx in layers:
                if whole:
                    digest = None
                    if checksums and self.hash_on_receive and t.stripe_checksums:
                        digest = self._digests[(seg.bank_row, layer_idx)] = xxhash.xxh3_64()
                    dest = ScatterDest(tuple(v for p in range(planes)
                                             for v in self.pieces(layer_idx, p, seg.bank_row, seg.num_blocks)),
                                       gate, digest)
                    by_shard[seg.shard_idx].append(
                        RangeRead(t.stripe_id, layer_idx, 0, t.layer_bytes, t.layer_bytes, dest))
                    continue
                for p in range(planes):
                    dest = ScatterDest(tuple(self.pieces(layer_idx, p, seg.bank_row, seg.num_blocks)), gate)
                    by_shard[seg.shard_idx].append(RangeRead(
                        t.stripe_id, layer_idx, (p * t.stripe_blocks + seg.first_block) * rb, seg.num_blocks * rb,
                        t.layer_bytes, dest))
        return by_shard

    def sums(self, layers: range, first_row: int, num_rows: int) -> list[int]:
        """xxh3-64 of rows ``[first_row, first_row + num_rows)`` of every plane (in order), per layer of ``layers``:
        the checksum a ticket records for those rows (:func:`range_connector.kv.stripes.chunk_checksum`). A whole-stripe
        read's checksum is the one the tier computed as the bytes landed (a read that did not complete leaves a
        checksum that does not match, and the chunks are then checked one by one, from their rows)."""
        digests = [self._digests.get((first_row, layer_idx)) for layer_idx in layers]
        if all(d is not None for d in digests) and any(
                seg.bank_row == first_row and seg.num_blocks == num_rows for seg in self.segments):
            return [d.intdigest() for d in digests]  # type: ignore[union-attr]
        out = []
        for layer_idx in layers:
            h = xxhash.xxh3_64()
            for p in range(self.num_planes):
                for piece in self.pieces(layer_idx, p, first_row, num_rows):
                    h.update(piece)
            out.append(h.intdigest())
        return out
