"""A pool of :class:`~range_connector.backends.valkey.resp.RespConnection` to one server, lent one per thread.

A connection is not thread-safe: :meth:`RespPool.connection` lends one for the duration of a ``with`` block, opening
it if none is idle, and takes it back unless the call closed it (a connection that failed is out of sync and is
replaced by the next borrow). The pool counts the round trips and commands of the connections it lends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from range_connector.backends.valkey.resp import PLAIN, RespConnection, RespSetup
from range_connector.errors import BackendError, BackendTimeoutError


class RespPool:
    """Up to ``max_connections`` connections to one server, shared by threads; closed ones are replaced lazily.

    Args:
        host: server address (unused with ``setup.unix_path``).
        port: TCP port (unused with ``setup.unix_path``).
        timeout_s: connect timeout and default call deadline, seconds.
        max_connections: how many connections may be open (and in use) at once.
        setup: unix socket, TLS, credentials and database of every connection (default: plain TCP, database 0).

    Attributes:
        round_trips: calls made through connections returned to the pool.
        commands_sent: commands sent through connections returned to the pool.
        name: how messages name the server (``setup.name``, else ``host:port`` or the socket path).
    """

    def __init__(self, host: str, port: int, timeout_s: float, max_connections: int = 2,
                 setup: RespSetup = PLAIN) -> None:
        self.host, self.port, self.timeout_s, self.setup = host, port, timeout_s, setup
        self.name = setup.name or setup.unix_path or f"{host}:{port}"
        self.round_trips = self.commands_sent = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._idle: list[RespConnection] = []
        self._closed = False

    @contextlib.contextmanager
    def connection(self, wait_s: float | None = None) -> Iterator[RespConnection]:
        """Borrow a connection for the duration of a ``with`` block (opened now if none is idle).

        Args:
            wait_s: how long to wait for a free slot, seconds; default the pool's ``timeout_s``.

        Raises:
            BackendTimeoutError: no connection became free in time.
            BackendError: a new connection could not be opened (or its ``AUTH``/``SELECT`` was refused).
        """
        if self._closed:
            raise BackendError(f"{self.name}: the connection pool is closed")
        if not self._slots.acquire(timeout=self.timeout_s if wait_s is None else wait_s):
            raise BackendTimeoutError(f"{self.name}: no free connection in the pool")
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = RespConnection(self.host, self.port, self.timeout_s, self.setup)
            before = (conn.round_trips, conn.commands_sent)
            try:
                yield conn
            finally:
                with self._lock:
                    self.round_trips += conn.round_trips - before[0]
                    self.commands_sent += conn.commands_sent - before[1]
                    if self._closed:
                        conn.close()
                    elif not conn.closed:
                        self._idle.append(conn)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Close the idle connections, and borrowed ones when they are returned; later borrows raise."""
        with self._lock:
            self._closed = True
            for conn in self._idle:
                conn.close()
            self._idle.clear()
