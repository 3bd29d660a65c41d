"""valkey-py calls of one Valkey backend on a persistent executor, each bounded by a deadline for the whole call.

A call that passes its deadline while it runs has the connection it borrowed shut down, and only that one: its
thread's read ends at once, a late reply can never be read by a later call, and other calls' connections (the
saver's in flight among them) are left alone. (A new thread per call, or a pool-wide disconnect at a timeout, was
what this replaced: threads grew with calls, and one timeout killed the saver's write.)

:func:`clients_for` makes the valkey-py client (on a :class:`CallPool`) and the RESP connections' setup of one server
from the same URL and access settings.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TypeVar

import valkey
import valkey.exceptions as vex

from range_connector.backends.valkey.resp import RespSetup
from range_connector.backends.valkey.urls import ServerUrl, ValkeyAccess, tls_context
from range_connector.errors import BackendError, BackendTimeoutError

#: threads of one backend's executor for valkey-py calls (scripts, small commands): how many such calls of one shard
#: run at once; more wait for a thread within their own deadline
CALL_WORKERS = 4

T = TypeVar("T")


class CallRecord:
    """The valkey-py connections one call holds right now (added and removed by its executor thread, in
    :class:`CallPool`), and whether its caller gave up on it."""

    __slots__ = ("aborted", "conns", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list = []
        self.aborted = False

    def abort(self) -> int:
        """Give up on the call: shut down the sockets it holds (their reads end at once, and nothing sent after
        this can be read from them) and refuse it further connections. Returns how many were shut down."""
        with self.lock:
            self.aborted = True
            for conn in self.conns:
                sock = getattr(conn, "_sock", None)  # (valkey-py's socket; None once disconnected)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:  # already closed by its thread
                        pass
            return len(self.conns)


_current_call = threading.local()  # .record: the CallRecord of the call this executor thread runs


class CallPool(valkey.ConnectionPool):
    """valkey-py's connection pool, which also tells the call running on the borrowing thread (if any) which
    connection it holds, so that a caller past its deadline can drop exactly that one."""

    def get_connection(self, command_name, *keys, **options):
        conn = super().get_connection(command_name, *keys, **options)
        record: CallRecord | None = getattr(_current_call, "record", None)
        if record is not None:
            with record.lock:
                if not record.aborted:
                    record.conns.append(conn)
                    return conn
            super().release(conn)  # (unused: still in sync)
            raise vex.ConnectionError("the call was given up at its deadline")
        return conn

    def release(self, connection) -> None:
        record: CallRecord | None = getattr(_current_call, "record", None)
        if record is not None:
            with record.lock:
                if connection in record.conns:
                    record.conns.remove(connection)
                if record.aborted:  # its socket may have been shut down: the next borrow reconnects
                    connection.disconnect()
        super().release(connection)


class CallRunner:
    """The executor of one backend's valkey-py calls.

    Args:
        name: the server as messages name it (credentials redacted).
        timeout_s: a call's deadline when its caller gives none, seconds.
    """

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=CALL_WORKERS, thread_name_prefix="range-valkey")
        self._lock = threading.Lock()
        self._in_flight: set[CallRecord] = set()
        self._closed = False

    def run(self, fn: Callable[[], T], deadline: float | None = None) -> T:
        """Run ``fn()`` (one valkey-py round trip) on the executor within ``timeout_s`` (or until ``deadline``, a
        ``time.monotonic()`` time shared by the steps of one public call).

        The socket timeout bounds each read; a server that trickles its reply would pass it, so the caller stops
        waiting at the deadline. A call still waiting for a thread then never starts; one that runs has the
        connection it borrowed shut down.

        Raises:
            BackendTimeoutError: no complete answer by the deadline.
            BackendError: the server refused or lost the call, or the runner is closed.
        """
        wait_s = self.timeout_s if deadline is None else deadline - time.monotonic()
        if wait_s <= 0:
            raise BackendTimeoutError(f"{self.name}: no complete answer within {self.timeout_s:g} s")
        record = CallRecord()

        def run_here() -> T:
            if record.aborted:  # (its caller gave up while it waited for a thread)
                raise BackendTimeoutError(f"{self.name}: given up before it started")
            _current_call.record = record
            try:
                return fn()
            finally:
                _current_call.record = None

        with self._lock:
            if self._closed:
                raise BackendError(f"{self.name}: the backend is closed")
            self._in_flight.add(record)
            future = self._executor.submit(run_here)
        try:
            done = bool(wait_futures([future], timeout=wait_s).done)
            if not done and not future.cancel():  # running: drop the connection it holds, and only that one
                record.abort()
        finally:
            with self._lock:
                self._in_flight.discard(record)
        if not done:
            raise BackendTimeoutError(f"{self.name}: no complete answer within {self.timeout_s:g} s")
        try:
            return future.result()
        except BackendError:
            raise
        except vex.TimeoutError as exc:
            raise BackendTimeoutError(f"{self.name}: no answer within the deadline ({exc})") from exc
        except (vex.ValkeyError, OSError) as exc:
            raise BackendError(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Give up the calls in flight (their connections shut down) and stop the executor; later calls raise
        :class:`BackendError`. Returns once the executor's threads have ended."""
        with self._lock:
            self._closed = True
            in_flight = list(self._in_flight)
        for record in in_flight:
            record.abort()
        self._executor.shutdown(wait=True, cancel_futures=True)


def clients_for(target: ServerUrl, access: ValkeyAccess, timeout_s: float) -> tuple[valkey.Valkey, RespSetup]:
    """The valkey-py client and the RESP connections' setup of one server, from the same URL and access settings.

    Raises:
        BackendError: TLS files for a URL that is not TLS, or TLS files that cannot be loaded.
    """
    if access.has_tls_files and not target.tls:
        raise BackendError(f"{target.shown}: TLS files are set (tiers[i].security.tls_*) but the URL is not "
                           "valkeys://")
    username, password = access.credentials(target)
    context = None
    kw: dict = {"db": target.db, "username": username, "password": password, "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s, "health_check_interval": 0}
    if target.unix_path is not None:
        kw["unix_socket_path"] = target.unix_path
    else:
        kw.update(host=target.host, port=target.port)
    if target.tls:
        try:
            context = tls_context(access)
        except (OSError, ssl.SSLError) as exc:
            raise BackendError(f"{target.shown}: cannot load the TLS files ({exc})") from None
        kw.update(ssl=True, ssl_ca_certs=access.tls_ca_file or None, ssl_certfile=access.tls_cert_file or None,
                  ssl_keyfile=access.tls_key_file or None, ssl_cert_reqs="required", ssl_check_hostname=True,
                  ssl_min_version=ssl.TLSVersion.TLSv1_2)
    setup = RespSetup(unix_path=target.unix_path, db=target.db, username=username, password=password, tls=context,
                      name=target.shown)
    # valkey-py picks the connection class (TCP, unix socket, TLS) from these keywords; the pool is then rebuilt as a
    # CallPool of that class, so that a call past its deadline can drop exactly the connection it holds.
    plain = valkey.Valkey(**kw).connection_pool
    pool = CallPool(connection_class=plain.connection_class, **plain.connection_kwargs)
    plain.disconnect()
    return valkey.Valkey(connection_pool=pool), setup
