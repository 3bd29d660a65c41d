"""The worker's counters (``saved_bytes``, ``load_backend_errors``, ...): one mapping that the step thread, the saver
thread, the asynchronous loader, the shard readers and the prober all add to, and that the connector reads each
step (``get_kv_connector_stats``).

``stats[name] += n`` on a plain dict is a read, an add and a write: two threads doing it at once can lose one of the
additions. :meth:`Counters.add` does the three under a lock. Reading needs no lock (a copy of a dict, ``dict(c)``,
happens at once under the interpreter lock), and a name never added reads as 0.
"""

from __future__ import annotations

import threading


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
