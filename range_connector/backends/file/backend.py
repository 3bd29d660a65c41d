"""File tier: one directory per shard (NVMe or any POSIX file system), shared by every process that opens it.

Layout under ``root_dir``:

* ``stripes/<sid>``: a 4096-byte header page (magic, layers, layer bytes, layer stride), then the layer values back
  to back, layer ``l`` at ``4096 + l * stride`` (``stride``: the layer size, rounded up to 4096 by a writer with
  ``use_odirect``). Self-describing: a reader opens no other file. Its mtime is the LRU clock (publish, read, lease).
* ``tickets/<generation>.log``: every ticket change, appended as one frame per call (``len``, ``crc32``, msgpack
  ops: put ``[1, key, sid, ticket]``, delete ``[0, key, sid or None]`` where a sid deletes only a ticket that still
  points at that stripe). Each instance replays the log into a dict and reads only what was appended since, so a
  lookup is one read whatever the number of keys (per-ticket files measured 15 us per key here: 62 ms for 4,096).
  Appends hold the lock; a writer rewrites the live tickets into the next generation when the log has grown 4x.
  Memory: about 0.7 KiB per ticket per process; a new process replays the log once (0.6 s per 100k tickets).
* ``leases/<sid>.<expiry ns, wall clock>.<uuid>``: empty files; one listing tells every process the live leases.
* ``*.tmp``: files being written, renamed into place. ``lock``: a file lock for eviction and publishing.

Capacity (C17): ``used_bytes`` is the sum over the stripe files in ``stripes/`` (in-flight ones included) of their
``st_size`` less the header page, read from the directory each time: it follows the files whatever removed them.
Under the lock, a save evicts least-recently-used unleased stripes (appending deletes of the tickets still pointing
at them first), then reserves its bytes by creating its temp file at full size; it writes the data without the lock
and publishes under it (rename, then append its tickets). The stripe bytes never exceed ``capacity_bytes``; the
budget excludes the header page (4 KiB per stripe) and the ticket log, as Valkey's excludes its keys. A crashed
writer's temp files (idle ``max(60, 10 * timeout_s)`` s) go at the next eviction; tickets of stripes that are gone
go at the next rewrite of the log.

Durability: a save's bytes are in the page cache before its tickets are published, so every process that sees a
ticket reads the stripe, even if the writer died. ``fsync=True`` adds power-loss durability (three fsyncs per
save); off by default: the tier is a cache, and a torn stripe reads as a miss (short file) or fails its checksum
one layer up. Bytes are returned as stored: a flipped byte reaches the caller, whose checksum (DESIGN.md §3.6)
catches it; headers and log frames are checked, and a damaged frame ends the log where it starts.

Every call is one round trip on an I/O thread pool with a deadline for the whole call (``BackendTimeoutError``);
I/O stops between system calls (at most 64 MiB each) once the caller has given up. ``commands`` counts I/O requests:
one per ``preadv``/``pwritev`` (a contiguous run of ranges), per header read, per ticket-log read or append; not
``open``/``rename``/``unlink``/``utime``. A read into a ``ScatterDest`` (a load straight into a host-memory KV
cache) is one ``preadv`` per MiB, each inside the destination's gate, its digest updated from the bytes just read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import struct
import threading
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import msgpack

from range_connector.backends.base import Backend, Buffer, RangeRead, ScatterDest, StripeWrite
from range_connector.errors import BackendError, BackendTimeoutError

logger = logging.getLogger(__name__)

PAGE = 4096
_HEADER = struct.Struct("<8sIQQ")  # magic, num_layers, layer_bytes, stride
_MAGIC = b"RCSTRIP1"
_FRAME = struct.Struct("<II")  # payload bytes, crc32 of the payload
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
_MAX_IO = 64 << 20  # bytes per system call
# Bytes per system call into a ScatterDest: its gate is held for one call at a time, and its digest is updated from
# bytes still in cache (512 MiB warm, paired against the same load through a bank: 1 MiB 0.57x, 8 MiB 0.59-0.70x).
_SCATTER_IO = 1 << 20
_COMPACT_MIN = 4 << 20  # ticket log bytes before it may be rewritten
_ZEROS = memoryview(bytes(PAGE))
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class DeviceRead:
    """Like :class:`RangeRead`, into ``dest``: a contiguous CUDA array (torch, CuPy) of exactly ``length`` bytes."""

    stripe_id: str
    layer_idx: int
    offset: int
    length: int
    value_bytes: int
    dest: Any


@functools.cache
def gds_status() -> tuple[bool, str]:
    """``(True, "")`` when kvikio is importable and a CUDA device is present, else ``(False, reason)``."""
    try:
        import kvikio  # noqa: F401
    except ImportError as exc:
        return False, f"kvikio not installed ({exc})"
    try:
        import torch
        if torch.cuda.is_available():
            return True, ""
    except ImportError:
        pass
    return False, "no CUDA device"


class _Call(threading.Event):
    """Set when the caller stops waiting; ``deadline`` in ``time.monotonic()`` seconds."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.deadline = time.monotonic() + timeout_s


class _Cancelled(Exception):
    """The caller gave up: issue no more I/O."""


class _Short(Exception):
    """The stripe file is shorter than its header says, or has no valid header: read as gone."""


def _flat(value: Buffer) -> memoryview:
    view = memoryview(value)
    if not view.contiguous:
        raise ValueError("file tier buffers must be contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _segments(items: Sequence[tuple[int, memoryview]], max_io: int = _MAX_IO) -> Iterator[tuple[int, list[memoryview]]]:
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


class FileBackend(Backend):
    """One shard's stripes as files under ``root_dir`` (layout and guarantees: module docstring).

    Args:
        root_dir: the shard's directory (created if missing).
        capacity_bytes: byte budget for the stripes' layer values (``None``: unlimited).
        timeout_s: deadline of every call, seconds (the whole call, lock waits included).
        num_io_threads: I/O threads (the stripes of one read_ranges call are read in parallel).
        use_odirect: read with O_DIRECT through 4096-aligned bounce buffers, bypassing the page cache, and pad
            layers to 4096 bytes when writing; buffered reads, with a log line, where the file system refuses.
        name: label for error messages (default ``file://<root_dir>``).
        fsync: fsync the stripe, the ticket log and the directory before a save returns.
        max_value_bytes: largest accepted layer value, bytes.

    Raises:
        BackendError: the directory cannot be created.
    """

    is_shared = True
    supports_scatter = True

    def __init__(self, root_dir: str | Path, capacity_bytes: int | None = None, *, timeout_s: float = 5.0,
                 num_io_threads: int = 4, use_odirect: bool = False, name: str | None = None, fsync: bool = False,
                 max_value_bytes: int = 1 << 40) -> None:
        self.root = Path(root_dir)
        super().__init__(name or f"file://{self.root}", max_value_bytes, capacity_bytes)
        try:
            for sub in ("stripes", "tickets", "leases"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"{self.name}: cannot create the tier directory ({exc})") from exc
        self.timeout_s = timeout_s
        self.use_odirect = self._direct_reads = use_odirect and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self._stale_ns = int(max(60.0, 10 * timeout_s) * 1e9)
        self._pool = ThreadPoolExecutor(num_io_threads, thread_name_prefix="range-file")
        self._lock = filelock.FileLock(str(self.root / "lock"), preserve_lock_file=True)
        self._local = threading.local()  # per-thread O_DIRECT bounce buffer
        self._evicted: list[bytes] = []
        # The ticket log as replayed here (guarded by _index_lock; appends also hold the file lock).
        self._index_lock = threading.Lock()
        self._log_fd: int | None = None
        self._gen = self._pos = self._log_base = 0
        self._tickets: dict[bytes, tuple[str, bytes]] = {}
        self._by_stripe: dict[str, set[bytes]] = defaultdict(set)
        self._damaged: tuple[int, int] | None = None

    @property
    def supports_gds(self) -> bool:
        """Whether :meth:`read_ranges_device` can read into CUDA memory through ``kvikio.CuFile``."""
        return gds_status()[0]

    # ------------------------------------------------------------------ plumbing
    def _run(self, what: str, tasks: Sequence) -> list:
        """Run ``task(call)`` callables on the pool within ``timeout_s`` for them all (one round trip)."""
        call = _Call(self.timeout_s)
        futures = [self._pool.submit(task, call) for task in tasks]
        _, pending = wait(futures, timeout=self.timeout_s)
        self._count(round_trips=1)
        try:
            if pending:
                raise _Cancelled
            return [f.result() for f in futures]
        except (_Cancelled, filelock.Timeout) as exc:
            raise BackendTimeoutError(f"{self.name}: {what} not done within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise BackendError(f"{self.name}: {what}: {type(exc).__name__}: {exc}") from exc
        finally:
            call.set()

    @contextlib.contextmanager
    def _locked(self, call: _Call) -> Iterator[None]:
        """Hold the file lock, unless the caller has given up (waiting no longer than its deadline)."""
        with self._lock.acquire(timeout=max(0.0, call.deadline - time.monotonic()), poll_interval=0.001):
            if call.is_set():
                raise _Cancelled
            yield

    def _path(self, sub: str, name: str) -> Path:
        return self.root / sub / name

    def _touch(self, target: int | Path) -> None:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.utime(target, ns=(time.time_ns(),) * 2)  # LRU: most recently used

    def _unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------ the ticket log
    def _log_gens(self) -> list[int]:
        return sorted(int(n[:-4]) for n in os.listdir(self.root / "tickets") if n.endswith(".log") and n[:-4].isdigit())

    def _open_log(self, gen: int, create: bool) -> None:
        fd = os.open(self._path("tickets", f"{gen:012d}.log"),
                     os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
        if self._log_fd is not None:
            os.close(self._log_fd)
        self._log_fd, self._gen, self._pos, self._log_base = fd, gen, 0, 0
        self._tickets, self._by_stripe = {}, defaultdict(set)

    def _catch_up(self, writer: bool) -> None:
        """Replay what was appended since the last call. Hold ``_index_lock`` (and the file lock if ``writer``:
        then switch to the newest generation, remove older ones, and cut a torn or damaged tail)."""
        if writer:
            gens = self._log_gens()
            if self._log_fd is None or not gens or gens[-1] != self._gen:
                self._open_log(gens[-1] if gens else 0, create=True)
            for gen in gens[:-1]:  # left by a writer that died while rewriting the log
                self._unlink(self._path("tickets", f"{gen:012d}.log"))
        elif self._log_fd is None or os.fstat(self._log_fd).st_nlink == 0:  # rewritten since: start over
            for gen in reversed(self._log_gens()):
                with contextlib.suppress(FileNotFoundError):
                    self._open_log(gen, create=False)
                    break
            else:
                return
        size = os.fstat(self._log_fd).st_size
        if size <= self._pos:
            return
        data = os.pread(self._log_fd, size - self._pos, self._pos)
        at = 0
        while at + _FRAME.size <= len(data):
            n, crc = _FRAME.unpack_from(data, at)
            end = at + _FRAME.size + n
            if end > len(data):
                break  # being appended (or torn)
            try:
                if zlib.crc32(data[at + _FRAME.size:end]) != crc:
                    raise ValueError("checksum mismatch")
                ops = msgpack.unpackb(data[at + _FRAME.size:end])
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                if self._damaged != (self._gen, self._pos + at):
                    self._damaged = (self._gen, self._pos + at)
                    logger.warning("%s: ticket log %d damaged at byte %d (%s): the tickets after it are ignored",
                                   self.name, self._gen, self._pos + at, exc)
                break
            self._apply(ops)
            at = end
        self._pos += at
        if writer and self._pos < size:  # we hold the lock: nobody is appending, this tail is torn or damaged
            os.ftruncate(self._log_fd, self._pos)

    def _apply(self, ops: list) -> None:
        """Apply logged ops (read from storage: anything malformed is skipped)."""
        for op in ops if isinstance(ops, list) else ():
            if not isinstance(op, list) or len(op) < 3 or not isinstance(op[1], bytes):
                continue
            key, sid, old = op[1], op[2], self._tickets.get(op[1])
            put = op[0] == 1 and len(op) == 4 and isinstance(sid, str) and isinstance(op[3], bytes)
            if old is not None and (put or (op[0] == 0 and sid in (None, old[0]))):
                del self._tickets[key]
                keys = self._by_stripe[old[0]]
                keys.discard(key)
                if not keys:
                    del self._by_stripe[old[0]]
            if put:
                self._tickets[key] = (sid, op[3])
                self._by_stripe[sid].add(key)

    def _append(self, ops: list) -> None:
        """Append one frame (hold the file lock and ``_index_lock``; after ``_catch_up(writer=True)``)."""
        payload = msgpack.packb(ops)
        frame = _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        written = os.write(self._log_fd, frame)
        self._count(commands=1)
        if written != len(frame):
            os.ftruncate(self._log_fd, self._pos)
            raise OSError(f"short write to the ticket log ({written} of {len(frame)} bytes)")
        if self.fsync:
            os.fsync(self._log_fd)
        self._apply(ops)
        self._pos += written
        self._log_base = self._log_base or self._pos
        if self._pos > max(_COMPACT_MIN, 4 * self._log_base):  # rewrite the live tickets as the next generation
            live = {n for n in os.listdir(self.root / "stripes") if n.isalnum()}
            payload = msgpack.packb([[1, k, sid, raw] for k, (sid, raw) in self._tickets.items() if sid in live])
            new = self._path("tickets", f"{self._gen + 1:012d}.log")
            tmp = new.with_name(f"{new.name}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "xb") as f:
                f.write(_FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
                if self.fsync:
                    os.fsync(f.fileno())
            os.rename(tmp, new)
            self._unlink(self._path("tickets", f"{self._gen:012d}.log"))
            self._catch_up(writer=True)
            self._log_base = self._pos

    def _publish(self, ops: list) -> None:
        with self._index_lock:
            self._catch_up(writer=True)
            self._append(ops)

    # ------------------------------------------------------------------ accounting and eviction (under the lock)
    def _scan(self) -> tuple[int, dict[str, tuple[int, int]], list[tuple[Path, int, int]]]:
        """``(used bytes, {sid: (mtime ns, bytes)}, [(temp file, mtime ns, bytes)])``; bytes exclude the header."""
        used, stripes, tmps = 0, {}, []
        for sub in ("stripes", "tickets"):
            with os.scandir(self.root / sub) as entries:
                for e in entries:
                    if sub == "tickets" and not e.name.endswith(".tmp"):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        st = e.stat(follow_symlinks=False)
                        size = max(0, st.st_size - PAGE) if sub == "stripes" else 0
                        used += size
                        if e.name.endswith(".tmp"):
                            tmps.append((Path(e.path), st.st_mtime_ns, size))
                        else:
                            stripes[e.name] = (st.st_mtime_ns, size)
        return used, stripes, tmps

    def _live_leases(self) -> set[str]:
        now, live = time.time_ns(), set()
        for sid, held in self._lease_files().items():
            for expiry, name in held:
                if expiry > now:
                    live.add(sid)
                else:  # an expired lease protects nothing
                    self._unlink(self._path("leases", name))
        return live

    def _lease_files(self) -> dict[str, list[tuple[int, str]]]:
        """``{sid: [(expiry ns, file name)]}`` of every lease file, earliest expiry first."""
        out: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for name in os.listdir(self.root / "leases"):
            parts = name.split(".")
            if len(parts) == 3 and parts[1].isdigit():
                out[parts[0]].append((int(parts[1]), name))
        for held in out.values():
            held.sort()
        return out

    def _make_room(self, need: int) -> bool:
        """Evict least-recently-used unleased stripes until ``need`` more bytes fit in the budget."""
        used, stripes, tmps = self._scan()
        if used + need <= self.capacity_bytes:
            return True
        now = time.time_ns()
        for path, mtime, size in tmps:  # temp files of writers that died
            if now - mtime > self._stale_ns and self._unlink(path):
                used -= size
        leased, victims = self._live_leases(), []
        for sid in sorted(stripes, key=lambda s: (stripes[s][0], s)):
            if used + need <= self.capacity_bytes:
                break
            if sid not in leased:
                victims.append(sid)
                used -= stripes[sid][1]
        if victims:
            with self._index_lock:  # tickets first: a crash here leaves a stripe without tickets, never the reverse
                self._catch_up(writer=True)
                ops = [[0, key, sid] for sid in victims for key in self._by_stripe.get(sid, ())]
                if ops:
                    self._append(ops)
                    self._evicted.extend(op[1] for op in ops)
            for sid in victims:
                self._unlink(self._path("stripes", sid))
        return used + need <= self.capacity_bytes

    # ------------------------------------------------------------------ protocol
    def used_bytes(self) -> int:
        return self._run("used_bytes", [lambda call: self._scan()[0]])[0]

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def task(call: _Call) -> list[bytes | None]:
            with self._index_lock:
                self._catch_up(writer=False)
                return [t[1] if (t := self._tickets.get(k)) is not None else None for k in keys]

        self._count(commands=1)
        return self._run("get_tickets", [task])[0]

    def write_stripe(self, write: StripeWrite) -> bool:
        self._check_write(write)
        views = [_flat(v) for v in write.layer_values]
        sid = write.stripe_id
        layer_bytes = views[0].nbytes if views else 0
        stride = -(-layer_bytes // PAGE) * PAGE if self.use_odirect else layer_bytes
        need = stride * len(views)
        if self.capacity_bytes is not None and need > self.capacity_bytes:
            self._count(round_trips=1, commands=1)
            return False
        header = bytearray(PAGE)
        _HEADER.pack_into(header, 0, _MAGIC, len(views), layer_bytes, stride)
        items = [(0, memoryview(header))]
        for layer_idx, view in enumerate(views):
            items.append((PAGE + layer_idx * stride, view))
            items.append((PAGE + layer_idx * stride + layer_bytes, _ZEROS[:stride - layer_bytes]))
        puts = [[1, bytes(k), sid, bytes(raw)] for k, raw in write.tickets]

        def task(call: _Call) -> bool:
            tmp = self._path("stripes", f"{sid}.{uuid.uuid4().hex}.tmp")
            with self._locked(call):
                if self.capacity_bytes is not None and not self._make_room(need):
                    return False
                fd = os.open(tmp, _NEW, 0o644)
                try:
                    os.ftruncate(fd, PAGE + need)  # the reservation: every process's scan counts it from now on
                except BaseException:
                    os.close(fd)
                    self._unlink(tmp)
                    raise
            try:
                for off, seg in _segments(items):
                    self._rw_all(os.pwritev, fd, seg, off, call)
                if self.fsync:
                    os.fsync(fd)
                with self._locked(call):
                    self._touch(fd)
                    os.rename(tmp, self._path("stripes", sid))
                    if puts:  # published last: a reader that sees a ticket finds its stripe
                        self._publish(puts)
                    if self.fsync:
                        dir_fd = os.open(self.root / "stripes", os.O_RDONLY | os.O_DIRECTORY)
                        os.fsync(dir_fd)
                        os.close(dir_fd)
            except BaseException:
                self._unlink(tmp)
                raise
            finally:
                os.close(fd)
            return True

        stored = self._run("write_stripe", [task])[0]
        if stored:
            self._count(bytes_written=write.nbytes)
        return stored

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        return self._per_stripe("read_ranges", reads, self._read_stripe)

    def _per_stripe(self, what: str, reads: Sequence, read_stripe) -> list[bool]:
        """Check every read, then one pool task per stripe (``read_stripe(sid, its reads, call) -> [ok]``)."""
        by_stripe: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(reads):
            if r.length < 1 or r.offset < 0 or r.offset + r.length > r.value_bytes or r.dest.nbytes != r.length:
                raise ValueError(f"{self.name}: read [{r.offset}, {r.offset + r.length}) into a {r.dest.nbytes}-byte "
                                 f"dest is outside stripe {r.stripe_id} layer {r.layer_idx} of {r.value_bytes} bytes")
            by_stripe[r.stripe_id].append(i)

        def task(sid: str, idxs: list[int]):
            return lambda call: (idxs, read_stripe(sid, [reads[i] for i in idxs], call))

        out = [False] * len(reads)
        for idxs, oks in self._run(what, [task(sid, idxs) for sid, idxs in by_stripe.items()]):
            for i, ok in zip(idxs, oks):
                out[i] = ok
        self._count(bytes_read=sum(r.length for r, ok in zip(reads, out) if ok), copy_launches=sum(out))
        return out

    def _open_stripe(self, sid: str, direct: bool) -> tuple[int, tuple[int, int, int]] | None:
        """Open a stripe and read its header: ``(fd, (num_layers, layer_bytes, stride))``; ``None`` if gone."""
        if not sid.isalnum():  # never a path outside stripes/
            return None
        try:
            fd = os.open(self._path("stripes", sid), os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            return None
        try:
            self._count(commands=1)
            if direct:
                raw = bytes(self._pread_direct(fd, [memoryview(bytearray(_HEADER.size))], 0, None)[0])
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

    def _plan(self, rs: Sequence[RangeRead | DeviceRead], layout: tuple[int, int, int]) -> list[int | None]:
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

    def _read_stripe(self, sid: str, rs: list[RangeRead], call: _Call) -> list[bool]:
        direct, opened = self._direct_reads, None
        try:
            if (opened := self._open_stripe(sid, direct)) is None:
                return [False] * len(rs)
            offsets = self._plan(rs, opened[1])
            items = sorted(((off, _flat(r.dest)) for off, r in zip(offsets, rs)  # type: ignore[arg-type]
                            if off is not None and not isinstance(r.dest, ScatterDest)), key=lambda item: item[0])
            for off, seg in _segments(items):
                if direct:
                    self._pread_direct(opened[0], seg, off, call)
                else:
                    self._rw_all(os.preadv, opened[0], seg, off, call)
            for off, r in zip(offsets, rs):
                if off is not None and isinstance(r.dest, ScatterDest):
                    self._read_scatter(opened[0], r.dest, off, direct, call)
            self._touch(opened[0])
            return [off is not None for off in offsets]
        except _Short:
            return [False] * len(rs)
        except OSError as exc:
            if not (direct and exc.errno == 22):  # EINVAL: this file system refuses O_DIRECT
                raise
            logger.warning("%s: O_DIRECT refused (%s); reading through the page cache", self.name, exc)
            self._direct_reads = False
        finally:
            if opened is not None:
                os.close(opened[0])
        return self._read_stripe(sid, rs, call)

    def _read_scatter(self, fd: int, dest: ScatterDest, off: int, direct: bool, call: _Call) -> None:
        """Read ``dest.nbytes`` bytes at ``off`` into the pieces of ``dest``: one ``preadv`` per run of at most
        ``_SCATTER_IO`` bytes, each inside the gate (an owner that closes it waits for one at most), then the
        digest is updated from the pieces just filled."""
        items, pos = [], off
        for piece in dest.pieces:
            items.append((pos, _flat(piece)))
            pos += piece.nbytes
        for seg_off, seg in _segments(items, _SCATTER_IO):
            landed = list(seg)
            with dest.gate:
                if direct:
                    self._pread_direct(fd, seg, seg_off, call)
                else:
                    self._rw_all(os.preadv, fd, seg, seg_off, call)
            if dest.digest is not None:
                for view in landed:
                    dest.digest.update(view)

    def _rw_all(self, op, fd: int, seg: list[memoryview], off: int, call: _Call) -> None:
        """``os.preadv``/``os.pwritev`` a contiguous run to the end; a read at end of file raises ``_Short``."""
        while seg:
            if call.is_set():
                raise _Cancelled
            n = op(fd, seg, off)
            self._count(commands=1)
            if n == 0:
                raise _Short
            off += n
            while seg and n >= seg[0].nbytes:
                n -= seg.pop(0).nbytes
            if seg:
                seg[0] = seg[0][n:]

    def _pread_direct(self, fd: int, seg: list[memoryview], off: int, call: _Call | None) -> list[memoryview]:
        """Read a contiguous run with O_DIRECT into an aligned bounce buffer, then copy it into ``seg``."""
        if call is not None and call.is_set():
            raise _Cancelled
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

    def read_ranges_device(self, reads: Sequence[DeviceRead]) -> list[bool]:
        """:meth:`read_ranges` into CUDA memory through ``kvikio.CuFile`` (GPUDirect Storage where the platform
        allows it, kvikio's POSIX compatibility mode otherwise). Same results and errors, one round trip.

        Raises:
            BackendError: kvikio or CUDA is missing (see :attr:`supports_gds`), or the read failed.
        """
        ok, reason = gds_status()
        if not ok:
            raise BackendError(f"{self.name}: GPUDirect reads unavailable: {reason}")
        import kvikio

        def read_stripe(sid: str, rs: list[DeviceRead], call: _Call) -> list[bool]:
            if (opened := self._open_stripe(sid, False)) is None:
                return [False] * len(rs)
            try:
                offsets = self._plan(rs, opened[1])
                todo = [(r, off) for r, off in zip(rs, offsets) if off is not None]
                with kvikio.CuFile(self._path("stripes", sid), "r") as f:
                    done = [fut.get() for fut in [f.pread(r.dest, r.length, off) for r, off in todo]]
                self._count(commands=len(todo))
                if done != [r.length for r, _ in todo]:
                    return [False] * len(rs)
                self._touch(opened[0])
                return [off is not None for off in offsets]
            finally:
                os.close(opened[0])

        return self._per_stripe("read_ranges_device", reads, read_stripe)

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        if not all(sid.isalnum() for sid in stripe_ids):
            raise ValueError(f"{self.name}: stripe ids must be alphanumeric: {list(stripe_ids)}")
        expiry = time.time_ns() + int(ttl_s * 1e9)
        token = uuid.uuid4().hex[:16]

        def task(call: _Call) -> None:
            for sid in stripe_ids:
                os.close(os.open(self._path("leases", f"{sid}.{expiry}.{token}"), _NEW, 0o644))
                self._touch(self._path("stripes", sid))

        self._count(commands=len(stripe_ids))
        self._run("lease", [task])
        return token

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        def task(call: _Call) -> None:
            held = self._lease_files() if stripe_ids else {}
            for sid in stripe_ids:
                if token is not None:  # exactly this holder's lease
                    for _expiry, name in held.get(sid, ()):
                        if name.endswith("." + token):
                            self._unlink(self._path("leases", name))
                    continue
                # the lease that expires first goes; if another process took it, the next one
                while held.get(sid) and not self._unlink(self._path("leases", held[sid].pop(0)[1])):
                    pass

        self._count(commands=len(stripe_ids))
        self._run("release", [task])

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        def task(call: _Call) -> None:
            if keys:
                with self._locked(call):
                    self._publish([[0, bytes(k), None] for k in keys])

        self._run("delete_tickets", [task])

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        ids = [sid for sid in stripe_ids if sid.isalnum()]

        def task(call: _Call) -> None:
            with self._locked(call):
                with self._index_lock:  # tickets first, as eviction does
                    self._catch_up(writer=True)
                    ops = [[0, key, sid] for sid in ids for key in self._by_stripe.get(sid, ())]
                    if ops:
                        self._append(ops)
                        self._evicted.extend(op[1] for op in ops)
                for sid in ids:
                    self._unlink(self._path("stripes", sid))

        if ids:
            self._run("drop_stripes", [task])

    def ping(self) -> None:
        self._run("ping", [lambda call: os.stat(self.root / "stripes")])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._index_lock.acquire(timeout=self.timeout_s):  # not while a blocked call holds it
            if self._log_fd is not None:
                os.close(self._log_fd)
                self._log_fd = None
            self._index_lock.release()

    def num_leases(self) -> int:
        """Live leases on this shard, held by any process (for tests and metrics)."""
        now = time.time_ns()
        return sum(1 for held in self._lease_files().values() for expiry, _ in held if expiry > now)

    def take_evicted(self) -> list[bytes]:
        """Return and forget the ticket keys that this instance's evictions dropped since the last call."""
        out, self._evicted = self._evicted, []
        return out
