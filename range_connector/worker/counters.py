"""The worker's counters (``saved_bytes``, ``load_backend_errors``, ...): one mapping that the step thread, the saver
thread, the asynchronous loader, the shard readers and the prober all add to, and that the connector reads each
step (``get_kv_connector_stats``).

``stats[name] += n`` on a plain dict is a read, an add and a write: two threads doing it at once can lose one of the
additions. :meth:`Counters.add` does the three under a lock, and :meth:`Counters.add_many` several names at once (a
histogram bucket's count and sum: :mod:`range_connector.histograms`); :meth:`Counters.snapshot` copies them under the
same lock, so that a report never holds one of those names without the other. A name never added reads as 0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class Counters(dict[str, int]):
    """``name -> count``, added to from several threads (values are ints; floats for sums of seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __missing__(self, name: str) -> int:
        return 0

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (atomically with respect to every other :meth:`add`)."""
        with self._lock:
            self[name] = self.get(name, 0) + n

    def add_many(self, items: Iterable[tuple[str, int | float]]) -> None:
        """Add each ``(name, n)`` of ``items``, all under one lock (no :meth:`snapshot` sees only some of them)."""
        with self._lock:
            for name, n in items:
                self[name] = self.get(name, 0) + n

    def snapshot(self) -> dict[str, int | float]:
        """A copy of every counter, taken under the lock of :meth:`add` and :meth:`add_many`."""
        with self._lock:
            return dict(self)
