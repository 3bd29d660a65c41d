"""The file tier's ticket log: every ticket change of one shard, appended to ``tickets/<generation>.log``.

Each call appends one frame (``len``, ``crc32``, msgpack ops: put ``[1, key, sid, ticket]``, delete
``[0, key, sid or None]`` where a sid deletes only a ticket that still points at that stripe). :class:`TicketLog`
replays the log into a dict and reads only what was appended since, so a lookup is one read whatever the number of
keys. Appends hold the shard's file lock; a writer rewrites the live tickets (those whose stripe file exists) into
the next generation when the log has grown 4x, and every instance follows to the new file. A damaged frame ends the
log where it starts (one warning); the next writer cuts a torn or damaged tail. An append that fails (a full file
system) leaves no part of its frame; a rewrite that fails leaves the current generation in use (one warning). The
tier's layout and guarantees: :mod:`range_connector.backends.file.backend`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import msgpack

from range_connector.backends.file.stripes import unlink

logger = logging.getLogger("range_connector.backends.file.backend")  # one logger for the whole file tier

_FRAME = struct.Struct("<II")  # payload bytes, crc32 of the payload
_COMPACT_MIN = 4 << 20  # ticket log bytes before it may be rewritten


class TicketLog:
    """The ticket log of one shard directory, as replayed in this process.

    Args:
        root: the shard's directory (the log is in ``tickets/``; a rewrite keeps the tickets of ``stripes/``).
        name: label for log lines.
        count: the backend's counter update (``count(commands=1)`` per append).
        fsync: fsync every append and every rewrite.

    Attributes:
        lock: guards the replayed state; every method takes it (appends also need the shard's file lock).
        tickets: ``{key: (stripe id, ticket)}`` as replayed here.
    """

    def __init__(self, root: Path, name: str, count: Callable[..., None], fsync: bool) -> None:
        self.root = root
        self.name = name
        self.fsync = fsync
        self._count = count
        self.lock = threading.Lock()
        self._log_fd: int | None = None
        self._gen = self._pos = self._log_base = 0
        self.tickets: dict[bytes, tuple[str, bytes]] = {}
        self._by_stripe: dict[str, set[bytes]] = defaultdict(set)
        self._damaged: tuple[int, int] | None = None
        self._rewrite_failed: int | None = None  # the generation whose rewrite last failed (warned once)
        self._dropped: list[bytes] = []

    def lookup(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The ticket of each key (``None``: none), after reading what was appended since the last call."""
        with self.lock:
            self._catch_up(writer=False)
            return [t[1] if (t := self.tickets.get(k)) is not None else None for k in keys]

    def publish(self, ops: list) -> None:
        """Append ``ops`` as one frame (hold the shard's file lock)."""
        with self.lock:
            self._catch_up(writer=True)
            self._append(ops)

    def drop_stripes(self, stripe_ids: Sequence[str]) -> None:
        """Delete the tickets that still point at ``stripe_ids``, in one frame (hold the shard's file lock); their
        keys are kept for :meth:`take_dropped`."""
        with self.lock:
            self._catch_up(writer=True)
            ops = [[0, key, sid] for sid in stripe_ids for key in self._by_stripe.get(sid, ())]
            if ops:
                self._append(ops)
                self._dropped.extend(op[1] for op in ops)

    def clear(self) -> None:
        """Delete every live ticket, in one frame (hold the shard's file lock)."""
        with self.lock:
            self._catch_up(writer=True)
            ops = [[0, key, None] for key in self.tickets]
            if ops:
                self._append(ops)

    def take_dropped(self) -> list[bytes]:
        """Return and forget the ticket keys that :meth:`drop_stripes` deleted since the last call."""
        out, self._dropped = self._dropped, []
        return out

    def close(self, timeout_s: float) -> None:
        """Close the log file, unless a blocked call holds the lock past ``timeout_s``."""
        if self.lock.acquire(timeout=timeout_s):  # not while a blocked call holds it
            if self._log_fd is not None:
                os.close(self._log_fd)
                self._log_fd = None
            self.lock.release()

    def _path(self, gen: int) -> Path:
        return self.root / "tickets" / f"{gen:012d}.log"

    def _log_gens(self) -> list[int]:
        return sorted(int(n[:-4]) for n in os.listdir(self.root / "tickets") if n.endswith(".log") and n[:-4].isdigit())

    def _open_log(self, gen: int, create: bool) -> None:
        fd = os.open(self._path(gen), os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
        if self._log_fd is not None:
            os.close(self._log_fd)
        self._log_fd, self._gen, self._pos, self._log_base = fd, gen, 0, 0
        self.tickets, self._by_stripe = {}, defaultdict(set)

    def _catch_up(self, writer: bool) -> None:
        """Replay what was appended since the last call. Hold ``lock`` (and the file lock if ``writer``: then
        switch to the newest generation, remove older ones, and cut a torn or damaged tail)."""
        if writer:
            gens = self._log_gens()
            if self._log_fd is None or not gens or gens[-1] != self._gen:
                self._open_log(gens[-1] if gens else 0, create=True)
            for gen in gens[:-1]:  # left by a writer that died while rewriting the log
                unlink(self._path(gen))
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
            key, sid, old = op[1], op[2], self.tickets.get(op[1])
            put = op[0] == 1 and len(op) == 4 and isinstance(sid, str) and isinstance(op[3], bytes)
            if old is not None and (put or (op[0] == 0 and sid in (None, old[0]))):
                del self.tickets[key]
                keys = self._by_stripe[old[0]]
                keys.discard(key)
                if not keys:
                    del self._by_stripe[old[0]]
            if put:
                self.tickets[key] = (sid, op[3])
                self._by_stripe[sid].add(key)

    def _append(self, ops: list) -> None:
        """Append one frame (hold the file lock and ``lock``; after ``_catch_up(writer=True)``)."""
        payload = msgpack.packb(ops)
        frame = _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
        self._count(commands=1)
        try:
            rest = memoryview(frame)
            while rest:  # (a short write is followed by one that says why: ENOSPC, EFBIG, ...)
                rest = rest[os.write(self._log_fd, rest):]
        except BaseException:
            os.ftruncate(self._log_fd, self._pos)  # an incomplete frame, which no reader takes: cut it
            raise
        if self.fsync:
            os.fsync(self._log_fd)
        self._apply(ops)
        self._pos += len(frame)
        self._log_base = self._log_base or self._pos
        if self._pos > max(_COMPACT_MIN, 4 * self._log_base):
            self._rewrite()

    def _rewrite(self) -> None:
        """Rewrite the live tickets as the next generation (hold the file lock and ``lock``). A failure (a full
        file system) leaves the current generation as it is, with one warning: the next append tries again."""
        live = {n for n in os.listdir(self.root / "stripes") if n.isalnum()}
        payload = msgpack.packb([[1, k, sid, raw] for k, (sid, raw) in self.tickets.items() if sid in live])
        new = self._path(self._gen + 1)
        tmp = new.with_name(f"{new.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "xb") as f:
                f.write(_FRAME.pack(len(payload), zlib.crc32(payload)) + payload)
                if self.fsync:
                    os.fsync(f.fileno())
            os.rename(tmp, new)
        except OSError as exc:
            unlink(tmp)
            if self._rewrite_failed != self._gen:
                self._rewrite_failed = self._gen
                logger.warning("%s: ticket log %d not rewritten (%s); kept as it is", self.name, self._gen, exc)
            return
        unlink(self._path(self._gen))
        self._catch_up(writer=True)
        self._log_base = self._pos
