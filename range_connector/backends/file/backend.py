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
* ``epoch``: how many times the shard was cleared (:meth:`FileBackend.clear`; absent: 0). A write reads it under the
  lock when it reserves its bytes and again when it publishes, and publishes nothing if it changed in between.

The factory puts each deployment's shards under ``<directory>/<deployment>/shard-<s>``, so deployments sharing a
directory have their own budget, LRU and clear.

Capacity (C17): ``used_bytes`` is the sum over the stripe files in ``stripes/`` (in-flight ones included) of their
``st_size`` less the header page, read from the directory each time: it follows the files whatever removed them.
Under the lock, a save evicts least-recently-used unleased stripes (appending deletes of the tickets still pointing
at them first), then reserves its bytes by creating its temp file at full size; it writes the data without the lock
and publishes under it (rename, then append its tickets). The stripe bytes never exceed ``capacity_bytes``; the
budget excludes the header page (4 KiB per stripe) and the ticket log, as Valkey's excludes its keys. A crashed
writer's temp files (idle ``max(60, 10 * timeout_s)`` s) go at the next eviction; tickets of stripes that are gone
go at the next rewrite of the log. A full file system (``ENOSPC``, ``EDQUOT``, wherever the save meets it) skips the
save: ``write_stripe`` returns ``False`` and counts ``saves_skipped_no_space`` (one log line until a save is stored
again, :attr:`FileBackend.out_of_space` meanwhile), having removed what it wrote (its temp file; its stripe, if its
tickets could not be appended).

Durability: a save's bytes are in the page cache before its tickets are published, so every process that sees a
ticket reads the stripe, even if the writer died. ``fsync=True`` adds power-loss durability (three fsyncs per
save); off by default: the tier is a cache, and a torn stripe reads as a miss (short file) or fails its checksum
one layer up. Bytes are returned as stored: a flipped byte reaches the caller, whose checksum (docs/architecture.md,
principle 6) catches it; headers and log frames are checked, and a damaged frame ends the log where it starts.

Every call is one round trip on an I/O thread pool with a deadline for the whole call (``BackendTimeoutError``);
I/O stops between system calls (at most 64 MiB each) once the caller has given up. ``commands`` counts I/O requests:
one per ``preadv``/``pwritev`` (a contiguous run of ranges), per header read, per ticket-log read or append; not
``open``/``rename``/``unlink``/``utime``. A read into a ``ScatterDest`` (a load straight into a host-memory KV
cache) is one ``preadv`` per MiB, each inside the destination's gate, its digest updated from the bytes just read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import filelock

from range_connector.backends.base import Backend, RangeRead, StripeWrite
from range_connector.backends.file.capacity import make_room, num_live_leases, release_leases, scan, take_leases
from range_connector.backends.file.gds import GdsSetup, gds_status
from range_connector.backends.file.stripes import (
    NEW_FILE,
    PAGE,
    Call,
    Cancelled,
    DeviceRead,
    StripeFiles,
    flat,
    logger,
    stripe_pieces,
    touch,
    unlink,
)
from range_connector.backends.file.ticket_log import TicketLog
from range_connector.errors import BackendError, BackendTimeoutError

#: errors of a file system that is full: the save is skipped (``saves_skipped_no_space``), never an error
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class FileBackend(Backend):
    """One shard's stripes as files under ``root_dir`` (layout and guarantees: module docstring).

    Composes the shard's :class:`~range_connector.backends.file.stripes.StripeFiles` (stripe reads),
    :class:`~range_connector.backends.file.ticket_log.TicketLog` (the tickets) and
    :mod:`~range_connector.backends.file.capacity` (the byte budget and leases), each call one round trip on an
    I/O thread pool.

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
        self.use_odirect = use_odirect and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self._stale_ns = int(max(60.0, 10 * timeout_s) * 1e9)
        self._pool = ThreadPoolExecutor(num_io_threads, thread_name_prefix="range-file")
        self._lock = filelock.FileLock(str(self.root / "lock"), preserve_lock_file=True)
        self._files = StripeFiles(self.root / "stripes", self.name, self._count, self.use_odirect)
        # The ticket log as replayed here (guarded by its lock; appends also hold the file lock).
        self._log = TicketLog(self.root, self.name, self._count, fsync)
        self.epoch_hint = self._epoch()  # (the file is replaced by a rename: readable without the lock)
        #: set when a save is skipped for lack of space on the file system (ENOSPC, EDQUOT), cleared by the next
        #: save stored
        self.out_of_space = False
        #: the start-up GPUDirect probe's outcome, set by a worker whose KV cache is in device memory
        #: (:func:`~range_connector.backends.file.gds.probe_gds`); ``None``: not probed
        self.gds: GdsSetup | None = None

    def refresh_epoch(self) -> None:
        self.epoch_hint = self._epoch()

    @property
    def direct_reads(self) -> bool:
        """Whether reads bypass the page cache with O_DIRECT now: ``use_odirect`` until the file system refuses it
        (``EINVAL``), then buffered reads for good, with one log line."""
        return self._files.direct_reads

    @property
    def supports_gds(self) -> bool:
        """Whether :meth:`read_ranges_device` can read into CUDA memory through ``kvikio.CuFile``."""
        return self.gds.io_path != "posix" if self.gds is not None else gds_status()[0]

    def serves_device_reads(self, stripe_id: str) -> bool:
        """Loads read this tier's stripes straight into device memory (the start-up probe passed and chose it)."""
        return self.gds is not None and self.gds.device_loads

    # ------------------------------------------------------------------ plumbing
    def _run(self, what: str, tasks: Sequence) -> list:
        """Run ``task(call)`` callables on the pool within ``timeout_s`` for them all (one round trip)."""
        call = Call(self.timeout_s)
        futures = [self._pool.submit(task, call) for task in tasks]
        _, pending = wait(futures, timeout=self.timeout_s)
        self._count(round_trips=1)
        try:
            if pending:
                raise Cancelled
            return [f.result() for f in futures]
        except (Cancelled, filelock.Timeout) as exc:
            raise BackendTimeoutError(f"{self.name}: {what} not done within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise BackendError(f"{self.name}: {what}: {type(exc).__name__}: {exc}") from exc
        finally:
            call.set()

    @contextlib.contextmanager
    def _locked(self, call: Call) -> Iterator[None]:
        """Hold the file lock, unless the caller has given up (waiting no longer than its deadline)."""
        with self._lock.acquire(timeout=max(0.0, call.deadline - time.monotonic()), poll_interval=0.001):
            if call.is_set():
                raise Cancelled
            yield

    # ------------------------------------------------------------------ protocol
    def used_bytes(self) -> int:
        return self._run("used_bytes", [lambda call: scan(self.root)[0]])[0]

    def get_tickets(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._count(commands=1)
        return self._run("get_tickets", [lambda call: self._log.lookup(keys)])[0]

    def write_stripe(self, write: StripeWrite) -> bool:
        self._check_write(write)
        views = [flat(v) for v in write.layer_values]
        sid = write.stripe_id
        need, items = stripe_pieces(views, pad=self.use_odirect)
        if self.capacity_bytes is not None and need > self.capacity_bytes:
            self._count(round_trips=1, commands=1)
            return False
        puts = [[1, bytes(k), sid, bytes(raw)] for k, raw in write.tickets]

        def store(call: Call) -> bool:
            tmp = self._files.path(f"{sid}.{uuid.uuid4().hex}.tmp")
            with self._locked(call):
                if self.capacity_bytes is not None and not make_room(self.root, need, self.capacity_bytes,
                                                                     self._stale_ns, self._log):
                    return False
                epoch = self._epoch() if write.epoch is None else write.epoch  # (gathered before a clear: refused)
                fd = os.open(tmp, NEW_FILE, 0o644)
                try:
                    os.ftruncate(fd, PAGE + need)  # the reservation: every process's scan counts it from now on
                except BaseException:
                    os.close(fd)
                    unlink(tmp)
                    raise
            try:
                self._files.write(fd, items, call)
                if self.fsync:
                    os.fsync(fd)
                with self._locked(call):
                    if self._epoch() != epoch:  # cleared since the save was gathered: store nothing
                        unlink(tmp)
                        self.epoch_hint = self._epoch()
                        return False
                    touch(fd)
                    os.rename(tmp, self._files.path(sid))
                    if puts:  # published last: a reader that sees a ticket finds its stripe
                        try:
                            self._log.publish(puts)
                        except BaseException:
                            # nobody will read it: a failed append leaves no part of its frame (only a failed
                            # fsync leaves its tickets, pointing at a stripe that is gone: a miss)
                            unlink(self._files.path(sid))
                            raise
                    if self.fsync:
                        dir_fd = os.open(self.root / "stripes", os.O_RDONLY | os.O_DIRECTORY)
                        os.fsync(dir_fd)
                        os.close(dir_fd)
            except BaseException:
                unlink(tmp)
                raise
            finally:
                os.close(fd)
            return True

        def task(call: Call) -> bool:
            try:
                stored = store(call)
            except OSError as exc:
                if exc.errno not in _NO_SPACE:
                    raise
                self._count(saves_skipped_no_space=1)  # (what it wrote was removed on the way out)
                if not self.out_of_space:
                    logger.warning("%s: no space left for stripe %s (%s); saves are skipped until there is",
                                   self.name, sid, exc)
                self.out_of_space = True
                return False
            if stored and self.out_of_space:
                logger.info("%s: saves are stored again", self.name)
                self.out_of_space = False
            return stored

        stored = self._run("write_stripe", [task])[0]
        if stored:
            self._count(bytes_written=write.nbytes)
        return stored

    def read_ranges(self, reads: Sequence[RangeRead]) -> list[bool]:
        return self._per_stripe("read_ranges", reads, self._files.read)

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

    def read_ranges_device(self, reads: Sequence[DeviceRead]) -> list[bool]:
        """:meth:`read_ranges` into CUDA memory through ``kvikio.CuFile`` (GPUDirect Storage where the platform
        allows it, kvikio's POSIX compatibility mode otherwise). Same results and errors, one round trip.

        Raises:
            BackendError: kvikio or CUDA is missing (see :attr:`supports_gds`), or the read failed.
        """
        ok, reason = (self.gds.io_path != "posix", self.gds.reason) if self.gds is not None else gds_status()
        if not ok:
            raise BackendError(f"{self.name}: GPUDirect reads unavailable: {reason}")
        import kvikio

        def read_stripe(sid: str, rs: list[DeviceRead], call: Call) -> list[bool]:
            if (opened := self._files.open(sid, False)) is None:
                return [False] * len(rs)
            try:
                offsets = self._files.plan(rs, opened[1])
                todo = [(r, off) for r, off in zip(rs, offsets) if off is not None]
                with kvikio.CuFile(self._files.path(sid), "r") as f:
                    done = [fut.get() for fut in [f.pread(r.dest, r.length, off) for r, off in todo]]
                self._count(commands=len(todo))
                if done != [r.length for r, _ in todo]:
                    return [False] * len(rs)
                touch(opened[0])
                return [off is not None for off in offsets]
            finally:
                os.close(opened[0])

        return self._per_stripe("read_ranges_device", reads, read_stripe)

    def lease(self, stripe_ids: Sequence[str], ttl_s: float) -> str:
        if not all(sid.isalnum() for sid in stripe_ids):
            raise ValueError(f"{self.name}: stripe ids must be alphanumeric: {list(stripe_ids)}")
        expiry = time.time_ns() + int(ttl_s * 1e9)
        token = uuid.uuid4().hex[:16]
        self._count(commands=len(stripe_ids))
        self._run("lease", [lambda call: take_leases(self.root, stripe_ids, expiry, token)])
        return token

    def release(self, stripe_ids: Sequence[str], token: str | None = None) -> None:
        self._count(commands=len(stripe_ids))
        self._run("release", [lambda call: release_leases(self.root, stripe_ids, token)])

    def delete_tickets(self, keys: Sequence[bytes]) -> None:
        def task(call: Call) -> None:
            if keys:
                with self._locked(call):
                    self._log.publish([[0, bytes(k), None] for k in keys])

        self._run("delete_tickets", [task])

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        ids = [sid for sid in stripe_ids if sid.isalnum()]

        def task(call: Call) -> None:
            with self._locked(call):
                self._log.drop_stripes(ids)  # tickets first, as eviction does
                for sid in ids:
                    unlink(self._files.path(sid))

        if ids:
            self._run("drop_stripes", [task])

    def clear(self) -> None:
        def task(call: Call) -> None:
            with self._locked(call):
                self._set_epoch(self._epoch() + 1)  # first: writes reserved before it refuse to publish
                self._log.clear()
                for sub in ("stripes", "leases"):  # (temp files of writes in flight included)
                    for name in os.listdir(self.root / sub):
                        unlink(self.root / sub / name)

        self._run("clear", [task])

    def _epoch(self) -> int:
        """The shard's reset epoch (hold the lock); an unreadable file counts as 0 (a clear rewrites it)."""
        try:
            return int((self.root / "epoch").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def _set_epoch(self, epoch: int) -> None:
        tmp = self.root / f"epoch.{uuid.uuid4().hex}.tmp"
        tmp.write_text(str(epoch))
        os.rename(tmp, self.root / "epoch")

    def ping(self) -> None:
        self._run("ping", [lambda call: os.stat(self.root / "stripes")])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._log.close(self.timeout_s)

    def num_leases(self) -> int:
        """Live leases on this shard, held by any process (for tests and metrics)."""
        return num_live_leases(self.root)

    def take_evicted(self, stamp: int | None = None) -> list[bytes]:
        """Return and forget the ticket keys that this instance's evictions dropped since the last call (``stamp``,
        the report's step, is not needed here: an evicted file is gone at once, and its load is a miss)."""
        return self._log.take_dropped()
