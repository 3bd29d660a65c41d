"""Stripe files of the file tier: their format, and the system calls that read and write them.

A stripe file (``stripes/<sid>``) is a 4096-byte header page (magic, layers, layer bytes, layer stride), then the
layer values back to back, layer ``l`` at ``4096 + l * stride`` (``stride``: the layer size, rounded up to 4096 by a
writer with ``use_odirect``). :func:`stripe_pieces` lays one out; :class:`StripeFiles` reads them: ranges of layers
with ``preadv`` (one per contiguous run of ranges, at most 64 MiB each), through 4096-aligned bounce buffers with
O_DIRECT, or into a :class:`ScatterDest` one MiB per call inside its gate. A header that does not check out, or a
file shorter than its header says, reads as a miss. Every I/O request is counted (``commands``), and I/O stops
between system calls once the caller has given up (:class:`Call`, :class:`Cancelled`). The tier's layout and
guarantees: :mod:`range_connector.backends.file.backend`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from range_connector.backends.base import Buffer, RangeRead, ScatterDest

logger = logging.getLogger("range_connector.backends.file.backend")  # one logger for the whole file tier

PAGE = 4096
_HEADER = struct.Struct("<8sIQQ")  # magic, num_layers, layer_bytes, stride
_MAGIC = b"RCSTRIP1"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
_MAX_IO = 64 << 20  # bytes per system call
# Bytes per system call into a ScatterDest: its gate is held for one call at a time, and its digest is updated from
# bytes still in cache (512 MiB warm, paired against the same load through a bank: 1 MiB 0.57x, 8 MiB 0.59-0.70x).
_SCATTER_IO = 1 << 20
_ZEROS = memoryview(bytes(PAGE))
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
"""``os.open`` flags of a file that must not exist yet (a stripe's temp file, a lease)."""


@dataclass(frozen=True, slots=True)
class DeviceRead:
    """Like :class:`RangeRead`, into ``dest``: a contiguous CUDA array (torch, CuPy) of exactly ``length`` bytes."""

    stripe_id: str
    layer_idx: int
    offset: int
    length: int
    value_bytes: int
    dest: Any


class Call(threading.Event):
    """Set when the caller stops waiting; ``deadline`` in ``time.monotonic()`` seconds."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.deadline = time.monotonic() + timeout_s


class Cancelled(Exception):
    """The caller gave up: issue no more I/O."""


class _Short(Exception):
    """The stripe file is shorter than its header says, or has no valid header: read as gone."""


def flat(value: Buffer) -> memoryview:
    """A flat byte view of a contiguous buffer (ValueError if it is not contiguous)."""
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("file tier buffers must be contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def segments(items: Sequence[tuple[int, memoryview]], max_io: int = _MAX_IO) -> Iterator[tuple[int, list[memoryview]]]:
    """Group ``(file offset, view)`` pieces, sorted by offset, into contiguous runs of at most ``_IOV_MAX`` views
    and ``max_io`` bytes: one ``preadv``/``pwritev`` each, whatever the number of chunks."""
    seg: list[memoryview] = []
    start = length = 0
    for off, view in items:
        while view.nbytes:
            if seg and (off != start + length or len(seg) == _IOV_MAX or length == max_io):
                yield start, seg
                seg, length = [], 0
            if not seg:
                start = off
            take = min(view.nbytes, max_io - length)
            seg.append(view[:take])
            length, off, view = length + take, off + take, view[take:]
    if seg:
        yield start, seg


def stripe_pieces(views: Sequence[memoryview], pad: bool) -> tuple[int, list[tuple[int, memoryview]]]:
    """Lay out a stripe file: ``(bytes after the header page, [(file offset, view)])``, the header page first, each
    layer at its stride (padded with zeros to 4096 bytes when ``pad``)."""
    layer_bytes = views[0].nbytes if views else 0
    stride = -(-layer_bytes // PAGE) * PAGE if pad else layer_bytes
    header = bytearray(PAGE)
    _HEADER.pack_into(header, 0, _MAGIC, len(views), layer_bytes, stride)
    items = [(0, memoryview(header))]
    for layer_idx, view in enumerate(views):
        items.append((PAGE + layer_idx * stride, view))
        items.append((PAGE + layer_idx * stride + layer_bytes, _ZEROS[:stride - layer_bytes]))
    return stride * len(views), items


def touch(target: int | Path) -> None:
    """Mark a file (path or descriptor) as most recently used: its mtime is the LRU clock."""
    with contextlib.suppress(FileNotFoundError, PermissionError):
        os.utime(target, ns=(time.time_ns(),) * 2)  # LRU: most recently used


def unlink(path: Path) -> bool:
    """Remove a file; ``False`` if it was already gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class StripeFiles:
    """Reads of the stripe files in one shard's ``stripes/`` directory, and the write loop of a new one.

    Args:
        directory: the shard's ``stripes/``.
        name: label for log lines and error messages.
        count: the backend's counter update (``count(commands=1)``, ``count(allocations=1)``).
        direct: read with O_DIRECT; :attr:`direct_reads` turns off, with a log line, where the file system refuses.
    """

    def __init__(self, directory: Path, name: str, count: Callable[..., None], direct: bool) -> None:
        self.dir = directory
        self.name = name
        self.direct_reads = direct
        self._count = count
        self._local = threading.local()  # per-thread O_DIRECT bounce buffer

    def path(self, sid: str) -> Path:
        return self.dir / sid

    def open(self, sid: str, direct: bool) -> tuple[int, tuple[int, int, int]] | None:
        """Open a stripe and read its header: ``(fd, (num_layers, layer_bytes, stride))``; ``None`` if gone."""
        if not sid.isalnum():  # never a path outside stripes/
            return None
        try:
            fd = os.open(self.path(sid), os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            return None
        try:
            self._count(commands=1)
            if direct:
                raw = bytes(self.pread_direct(fd, [memoryview(bytearray(_HEADER.size))], 0, None)[0])
            else:
                raw = os.pread(fd, _HEADER.size, 0)
            magic, num_layers, layer_bytes, stride = _HEADER.unpack(raw)
            if magic != _MAGIC or stride < layer_bytes:
                raise _Short
            return fd, (num_layers, layer_bytes, stride)
        except (_Short, struct.error):
            os.close(fd)
            logger.warning("%s: stripe %s has no valid header; read as a miss", self.name, sid)
            return None
        except BaseException:
            os.close(fd)
            raise

    def plan(self, rs: Sequence[RangeRead | DeviceRead], layout: tuple[int, int, int]) -> list[int | None]:
        """File offset of each read (``None``: no such layer). Raises ValueError for a range outside the value."""
        num_layers, layer_bytes, stride = layout
        offsets: list[int | None] = []
        for r in rs:
            if not 0 <= r.layer_idx < num_layers:
                offsets.append(None)
            elif r.offset + r.length > layer_bytes:
                raise ValueError(f"{self.name}: read [{r.offset}, {r.offset + r.length}) of stripe {r.stripe_id} "
                                 f"layer {r.layer_idx} is outside its {layer_bytes} bytes")
            else:
                offsets.append(PAGE + r.layer_idx * stride + r.offset)
        return offsets

    def read(self, sid: str, rs: list[RangeRead], call: Call) -> list[bool]:
        """Read ranges of one stripe into their destinations: ``[found]`` per read (a stripe that is gone, or too
        short, reads as a miss)."""
        direct, opened = self.direct_reads, None
        try:
            if (opened := self.open(sid, direct)) is None:
                return [False] * len(rs)
            offsets = self.plan(rs, opened[1])
            items = sorted(((off, flat(r.dest)) for off, r in zip(offsets, rs)  # type: ignore[arg-type]
                            if off is not None and not isinstance(r.dest, ScatterDest)), key=lambda item: item[0])
            for off, seg in segments(items):
                if direct:
                    self.pread_direct(opened[0], seg, off, call)
                else:
                    self.rw_all(os.preadv, opened[0], seg, off, call)
            for off, r in zip(offsets, rs):
                if off is not None and isinstance(r.dest, ScatterDest):
                    self.read_scatter(opened[0], r.dest, off, direct, call)
            touch(opened[0])
            return [off is not None for off in offsets]
        except _Short:
            return [False] * len(rs)
        except OSError as exc:
            if not (direct and exc.errno == 22):  # EINVAL: this file system refuses O_DIRECT
                raise
            logger.warning("%s: O_DIRECT refused (%s); reading through the page cache", self.name, exc)
            self.direct_reads = False
        finally:
            if opened is not None:
                os.close(opened[0])
        return self.read(sid, rs, call)

    def read_scatter(self, fd: int, dest: ScatterDest, off: int, direct: bool, call: Call) -> None:
        """Read ``dest.nbytes`` bytes at ``off`` into the pieces of ``dest``: one ``preadv`` per run of at most
        ``_SCATTER_IO`` bytes, each inside the gate (an owner that closes it waits for one at most), then the
        digest is updated from the pieces just filled."""
        items, pos = [], off
        for piece in dest.pieces:
            items.append((pos, flat(piece)))
            pos += piece.nbytes
        for seg_off, seg in segments(items, _SCATTER_IO):
            landed = list(seg)
            with dest.gate:
                if direct:
                    self.pread_direct(fd, seg, seg_off, call)
                else:
                    self.rw_all(os.preadv, fd, seg, seg_off, call)
            if dest.digest is not None:
                for view in landed:
                    dest.digest.update(view)

    def rw_all(self, op, fd: int, seg: list[memoryview], off: int, call: Call) -> None:
        """``os.preadv``/``os.pwritev`` a contiguous run to the end; a read at end of file raises ``_Short``."""
        while seg:
            if call.is_set():
                raise Cancelled
            n = op(fd, seg, off)
            self._count(commands=1)
            if n == 0:
                raise _Short
            off += n
            while seg and n >= seg[0].nbytes:
                n -= seg.pop(0).nbytes
            if seg:
                seg[0] = seg[0][n:]

    def write(self, fd: int, items: Sequence[tuple[int, memoryview]], call: Call) -> None:
        """Write the pieces of :func:`stripe_pieces` into ``fd``: one ``pwritev`` per contiguous run."""
        for off, seg in segments(items):
            self.rw_all(os.pwritev, fd, seg, off, call)

    def pread_direct(self, fd: int, seg: list[memoryview], off: int, call: Call | None) -> list[memoryview]:
        """Read a contiguous run with O_DIRECT into an aligned bounce buffer, then copy it into ``seg``."""
        if call is not None and call.is_set():
            raise Cancelled
        if (bounce := getattr(self._local, "bounce", None)) is None:
            bounce = self._local.bounce = memoryview(mmap.mmap(-1, _MAX_IO + 2 * PAGE))
            self._count(allocations=1)
        end = off + sum(v.nbytes for v in seg)
        start = off - off % PAGE
        n = os.preadv(fd, [bounce[:-(-end // PAGE) * PAGE - start]], start)
        if call is not None:
            self._count(commands=1)
        if n < end - start:
            raise _Short
        pos = off - start
        for view in seg:
            view[:] = bounce[pos:pos + view.nbytes]
            pos += view.nbytes
        return seg
