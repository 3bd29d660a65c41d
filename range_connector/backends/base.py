"""The backend protocol: a byte store addressed by keys, one instance per shard.

Contract (checked by ``tests/backends``, run against every backend):

* ``put_many`` stores whole values; a later ``get_many`` returns exactly those bytes (or ``None`` if the value was
  evicted or never stored); a key that was never written is a miss, never an error.
* ``lookup_prefix(keys)`` returns how many leading keys are present, in one round trip whatever the number of keys.
* Every call has a deadline: a tier that does not answer raises :class:`BackendTimeoutError`; any other failure
  raises :class:`BackendError`. Callers turn both into misses or load errors.
* Counters (:class:`BackendCounters`) count round trips, commands, bytes and allocations, so tests can check that
  cost follows bytes rather than objects.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class BackendCounters:
    """Cumulative work done by one backend instance (client side)."""

    round_trips: int = 0
    commands: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    allocations: int = 0
    copy_launches: int = 0

    def snapshot(self) -> dict[str, int]:
        """Return the counters as a plain dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Backend(abc.ABC):
    """One shard's storage tier.

    Attributes:
        name: human-readable tier and address, used in error messages (e.g. ``valkey://127.0.0.1:6379``).
        max_value_bytes: the largest value the tier accepts.
        counters: cumulative :class:`BackendCounters`.
    """

    #: Whether sub-ranges of a value can be read without reading the whole value.
    supports_ranged_reads: bool = False
    #: Whether the bytes survive the process that wrote them (another process can read them).
    is_shared: bool = False

    def __init__(self, name: str, max_value_bytes: int) -> None:
        self.name = name
        self.max_value_bytes = max_value_bytes
        self.counters = BackendCounters()
        self._counters_lock = threading.Lock()

    def _count(self, *, round_trips: int = 0, commands: int = 0, bytes_written: int = 0, bytes_read: int = 0,
               allocations: int = 0) -> None:
        with self._counters_lock:
            c = self.counters
            c.round_trips += round_trips
            c.commands += commands
            c.bytes_written += bytes_written
            c.bytes_read += bytes_read
            c.allocations += allocations

    @abc.abstractmethod
    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """Count the leading keys that are present (one round trip).

        Args:
            keys: ``[num_keys]`` keys in chain order.

        Returns:
            ``n`` such that ``keys[:n]`` are all present and ``keys[n]`` is not (or ``n == num_keys``).

        Raises:
            BackendTimeoutError, BackendError.
        """

    @abc.abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """Store values (one round trip). Each value must be at most :attr:`max_value_bytes`.

        Raises:
            ValueError: a value is larger than :attr:`max_value_bytes` (nothing of this call is stored).
            BackendTimeoutError, BackendError.
        """

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Read whole values (one round trip); ``None`` for a missing key.

        Raises:
            BackendTimeoutError, BackendError.
        """

    @abc.abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Delete keys (one round trip); return how many existed.

        Raises:
            BackendTimeoutError, BackendError.
        """

    def ping(self) -> None:
        """Check that the tier answers.

        Raises:
            BackendTimeoutError, BackendError.
        """

    def close(self) -> None:
        """Release connections; the stored bytes stay where the tier keeps them."""

    def _check_sizes(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        for key, value in items:
            size = memoryview(value).nbytes
            if size > self.max_value_bytes:
                raise ValueError(
                    f"{self.name}: value for key {key!r} is {size} bytes, over the tier's limit of "
                    f"{self.max_value_bytes} bytes"
                )
