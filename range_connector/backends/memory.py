"""In-process DRAM tier: the reference implementation of the backend protocol and the test oracle.

Values live in this process (a worker process when serving); a byte budget is enforced by evicting the least
recently used values. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from range_connector.backends.base import Backend, Buffer


class MemoryBackend(Backend):
    """A byte store in this process's memory.

    Args:
        capacity_bytes: byte budget; storing past it evicts least-recently-used values.
        name: label for error messages.
        max_value_bytes: largest accepted value (default: the capacity).
    """

    def __init__(self, capacity_bytes: int, name: str = "memory", max_value_bytes: int | None = None) -> None:
        super().__init__(name, max_value_bytes if max_value_bytes is not None else capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._used_bytes = 0
        self._lock = threading.Lock()
        #: keys dropped by eviction since the last :meth:`take_evicted` (the scheduler's index learns of them).
        self._evicted: list[bytes] = []

    @property
    def used_bytes(self) -> int:
        """Bytes currently stored."""
        return self._used_bytes

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        self._count(round_trips=1, commands=len(keys))
        with self._lock:
            for n, key in enumerate(keys):
                if key not in self._values:
                    return n
                self._values.move_to_end(key)
            return len(keys)

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        self._check_sizes(items)
        total = sum(memoryview(v).nbytes for _, v in items)
        self._count(round_trips=1, commands=len(items), bytes_written=total, allocations=len(items))
        with self._lock:
            for key, value in items:
                data = bytes(value)
                old = self._values.pop(key, None)
                if old is not None:
                    self._used_bytes -= len(old)
                if len(data) > self.capacity_bytes:
                    continue
                while self._used_bytes + len(data) > self.capacity_bytes:
                    gone_key, gone = self._values.popitem(last=False)
                    self._used_bytes -= len(gone)
                    self._evicted.append(gone_key)
                self._values[key] = data
                self._used_bytes += len(data)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            out = [self._values.get(k) for k in keys]
            for k, v in zip(keys, out):
                if v is not None:
                    self._values.move_to_end(k)
        self._count(round_trips=1, commands=len(keys), bytes_read=sum(len(v) for v in out if v is not None))
        return out

    def delete_many(self, keys: Sequence[bytes]) -> int:
        self._count(round_trips=1, commands=len(keys))
        n = 0
        with self._lock:
            for k in keys:
                v = self._values.pop(k, None)
                if v is not None:
                    self._used_bytes -= len(v)
                    n += 1
        return n

    def ping(self) -> None:
        self._count(round_trips=1, commands=1)

    def take_evicted(self) -> list[bytes]:
        """Return and forget the keys evicted since the last call."""
        with self._lock:
            out, self._evicted = self._evicted, []
        return out
