"""Deadlines and failures that only a remote tier has, on the Valkey tier (each on databases 0 and 1; both take the
RESP data path since every URL kind does): the server's value limit, a frozen server (SIGSTOP), a write that times out, a trickling server (C21), a
closed port, an oversize write against a stale limit (C19), and two shard servers that stay independent.

Stripes come from the conformance suite's helpers (``tests/backends/conformance.py``); servers from the fixtures of
``tests/conftest.py``.

No test here bounds how long a failing call took by anything but a wide margin (:data:`WIDE_S`, which only a hang
reaches): what is checked is that it failed with the right error, no earlier than its deadline, and (where a call
has several steps) that every step was given the call's one deadline.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable

import pytest
import valkey

from range_connector.backends.base import RangeRead
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.errors import BackendError, BackendTimeoutError
from tests.backends.conformance import (
    SERVER_LIMIT_BYTES,
    MiB,
    audit_valkey,
    make_stripe,
    read_whole,
)

WIDE_S = 10.0  # a failing call that takes this long hangs (its deadlines here are 0.5-2 s)


# ---------------------------------------------------------------------------------------------------- Valkey only
class _TricklingServer:
    """A fake Valkey server on loopback: it answers the start-up handshake at once, then sends the reply of every
    GET, GETRANGE and MGET one byte per ``interval_s``. It keeps answering, so no single socket read times out, but
    the call as a whole takes ``len(reply) * interval_s``."""

    SLOW_REPLIES = {b"GET": b"$8\r\nslowslow\r\n", b"GETRANGE": b"$8\r\nslowslow\r\n", b"MGET": b"*1\r\n$4\r\nslow\r\n"}

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"valkey://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                header = reader.readline()
                if not header.startswith(b"*"):
                    return
                args = []
                for _ in range(int(header[1:])):
                    size = int(reader.readline()[1:])
                    args.append(reader.read(size + 2)[:-2])
                command = args[0].upper()
                if command == b"PING":
                    conn.sendall(b"+PONG\r\n")
                elif command == b"CONFIG":
                    conn.sendall(b"*2\r\n$18\r\nproto-max-bulk-len\r\n$9\r\n536870912\r\n")
                elif command in self.SLOW_REPLIES:
                    for byte in self.SLOW_REPLIES[command]:
                        if self._stop.wait(self.interval_s):
                            return
                        conn.sendall(bytes([byte]))
                else:
                    conn.sendall(b"+OK\r\n")
        except (OSError, ValueError):
            return
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=2.0)


def _url_pattern(url: str) -> str:
    """Errors name the server: its URL (valkey-py path) or its address (RESP path)."""
    return re.escape(url.removeprefix("valkey://").split("/")[0])


@pytest.fixture(params=[0, 1], ids=["resp", "resp-db1"])
def db(request: pytest.FixtureRequest) -> int:
    """Database 0, or 1 (selected once per RESP connection: the same data path)."""
    return request.param


def _db_url(url: str, db: int) -> str:
    return url if db == 0 else f"{url}/{db}"


class TestValkeyFailures:
    """Deadlines and failures of the Valkey tier (each on both data paths)."""

    @pytest.mark.timeout(20)
    def test_max_value_bytes_follows_the_server_limit(self, dedicated_valkey) -> None:
        url = dedicated_valkey.urls[0]
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            default = ValkeyBackend(url, timeout_s=2.0)
            admin.config_set("proto-max-bulk-len", 3 * MiB)
            lowered = ValkeyBackend(url, timeout_s=2.0)
        finally:
            admin.close()
        assert 500 * MiB < default.max_value_bytes < 512 * MiB
        assert 2 * MiB < lowered.max_value_bytes < 3 * MiB
        assert default.name == url and default.is_shared
        default.close()
        lowered.close()

    @pytest.mark.timeout(30)
    def test_frozen_server_raises_timeout_within_the_deadline(self, dedicated_valkey, db: int) -> None:
        url, pid = _db_url(dedicated_valkey.urls[0], db), dedicated_valkey.pids[0]
        timeout_s = 0.5
        s = make_stripe(1)
        b = ValkeyBackend(url, timeout_s=timeout_s)
        budgeted = ValkeyBackend(url, timeout_s=timeout_s, capacity_bytes=100 * s.nbytes)
        assert b.write_stripe(s.write) is True
        n = s.layer_bytes
        calls: list[tuple[str, Callable[[], object]]] = [
            ("get_tickets", lambda: b.get_tickets(s.keys)),
            ("read_ranges", lambda: b.read_ranges([RangeRead(s.sid, 0, 0, n, n, memoryview(bytearray(n)))])),
            ("write_stripe", lambda: b.write_stripe(make_stripe(2).write)),
            ("write_stripe with a budget", lambda: budgeted.write_stripe(make_stripe(3).write)),
            ("lease", lambda: b.lease([s.sid], ttl_s=30)),
            ("release", lambda: b.release([s.sid])),
            ("delete_tickets", lambda: b.delete_tickets(s.keys[:1])),
        ]
        os.kill(pid, signal.SIGSTOP)
        try:
            for name, call in calls:
                start = time.monotonic()
                with pytest.raises(BackendTimeoutError, match=_url_pattern(url)) as exc_info:
                    call()
                elapsed_s = time.monotonic() - start
                assert timeout_s <= elapsed_s < WIDE_S, (name, elapsed_s)  # it waited out its deadline, no more
                assert isinstance(exc_info.value, BackendError) and isinstance(exc_info.value, TimeoutError)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Once the server answers again the connections are usable, and no stale reply of a timed-out call is read
        # as the answer to a new one.
        time.sleep(0.1)
        for _ in range(3):
            got = b.get_tickets(s.keys)
            assert got[1:] == s.encoded[1:] and got[0] in (None, s.encoded[0])
            assert read_whole(b, s) == [s.values]
        b.close()
        budgeted.close()

    @pytest.mark.timeout(30)
    def test_write_that_times_out_keeps_the_byte_accounting(self, dedicated_valkey, db: int, monkeypatch) -> None:
        # The server freezes after the budget was reserved, while the stripe's values are on their way: the write
        # fails at its one deadline (not one per step), and whether or not the server applies the values later,
        # the tier's byte count still equals the bytes of the stripes it lists (no drift, no orphaned values).
        url, pid = _db_url(dedicated_valkey.urls[0], db), dedicated_valkey.pids[0]
        timeout_s = 1.0
        s = make_stripe(1)
        b = ValkeyBackend(url, timeout_s=timeout_s, capacity_bytes=4 * s.nbytes)
        assert b.write_stripe(s.write) is True
        data_path = "_resp_run"  # what sends the values (after the reservation)
        send = getattr(b, data_path)
        deadlines: list[float | None] = []

        def freeze_then_send(*args, **kwargs):
            os.kill(pid, signal.SIGSTOP)
            deadlines.append(kwargs["deadline"] if "deadline" in kwargs else args[2] if len(args) > 2 else None)
            return send(*args, **kwargs)

        monkeypatch.setattr(b, data_path, freeze_then_send)
        late = make_stripe(2)
        start = time.monotonic()
        try:
            with pytest.raises(BackendTimeoutError, match=_url_pattern(url)):
                b.write_stripe(late.write)
            elapsed_s = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        monkeypatch.undo()
        # The values were sent with the deadline the write set before its reservation (one for the whole call, not
        # a fresh one per step), and the write failed there.
        [deadline] = deadlines
        assert deadline is not None and start + timeout_s <= deadline <= start + elapsed_s
        assert timeout_s <= elapsed_s < WIDE_S
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            time.sleep(0.2)  # let the server apply whatever reached it
            audit_valkey(admin)
            assert b.used_bytes() <= b.capacity_bytes
            # The budget is not leaked: the tier fills up to its capacity again.
            for i in range(4):
                assert b.write_stripe(make_stripe(10 + i).write) is True
            audit_valkey(admin)
            assert b.used_bytes() == 4 * s.nbytes
        finally:
            admin.close()
            b.close()

    @pytest.mark.timeout(20)
    def test_case_C21_trickling_server_raises_timeout_within_the_deadline(self, db: int) -> None:
        # One key answers after a very long delay. Each byte arrives within the socket timeout, so only a per-call
        # deadline catches it. (A reply takes 7 s or more, far past the 1 s deadline: the call can only fail.)
        timeout_s = 1.0
        server = _TricklingServer(interval_s=timeout_s / 2)
        try:
            b = ValkeyBackend(_db_url(server.url, db), timeout_s=timeout_s)
            calls = [
                ("get_tickets", lambda: b.get_tickets([b"t:slow"])),
                ("read_ranges", lambda: b.read_ranges([RangeRead("slow", 0, 0, 8, 8, memoryview(bytearray(8)))])),
                ("read_ranges sub-range",
                 lambda: b.read_ranges([RangeRead("slow", 0, 2, 4, 8, memoryview(bytearray(4)))])),
            ]
            try:
                for name, call in calls:
                    start = time.monotonic()
                    with pytest.raises(BackendTimeoutError, match=_url_pattern(server.url)):
                        call()
                    assert timeout_s <= time.monotonic() - start < WIDE_S, name
            finally:
                b.close()
        finally:
            server.close()

    @pytest.mark.timeout(20)
    def test_closed_port_raises_backend_error_naming_the_url(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        url = f"valkey://127.0.0.1:{port}"  # nothing listens there any more

        start = time.monotonic()
        with pytest.raises(BackendError, match=url):
            ValkeyBackend(url, timeout_s=1.0)
        assert time.monotonic() - start < WIDE_S  # (refused: not retried until some far deadline)

    @pytest.mark.timeout(20)
    def test_case_C19_oversize_write_against_a_stale_limit_fails_cleanly(self, dedicated_valkey, db: int) -> None:
        # The limit was read at start-up and the server's was lowered later: the oversize write fails with a typed
        # error (not a hang), publishes no ticket, leaves the accounting straight, and the connections stay healthy.
        url = _db_url(dedicated_valkey.urls[0], db)
        s = make_stripe(1)
        b = ValkeyBackend(url, timeout_s=2.0, capacity_bytes=8 * SERVER_LIMIT_BYTES)
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        try:
            assert b.write_stripe(s.write) is True
            admin.config_set("proto-max-bulk-len", SERVER_LIMIT_BYTES)
            big = make_stripe(2, num_layers=2, num_chunks=1, blocks_per_chunk=1, num_planes=1,
                              row_bytes=2 * SERVER_LIMIT_BYTES)
            start = time.monotonic()
            with pytest.raises(BackendError):
                b.write_stripe(big.write)
            assert time.monotonic() - start < WIDE_S  # a typed error, not a hang
            assert admin.exists(big.keys[0]) == 0
            audit_valkey(admin)
            for _ in range(3):
                assert b.get_tickets(s.keys + big.keys) == s.encoded + [None]
                assert read_whole(b, s) == [s.values]
            small = make_stripe(3)
            assert b.write_stripe(small.write) is True
            assert read_whole(b, small) == [small.values]
        finally:
            admin.close()
            b.close()

    @pytest.mark.timeout(20)
    def test_backends_on_two_shard_servers_are_independent(self, valkey_servers) -> None:
        b0, b1 = (ValkeyBackend(url, timeout_s=5.0) for url in valkey_servers.urls[:2])
        admins = [valkey.Valkey.from_url(url, socket_timeout=5.0) for url in valkey_servers.urls[:2]]
        try:
            s = make_stripe(1)
            assert b0.write_stripe(s.write) is True
            assert b1.get_tickets(s.keys) == [None] * len(s.keys)
            assert read_whole(b1, s) == [None]
            assert b0.get_tickets(s.keys) == s.encoded
        finally:
            b0.close()
            b1.close()
            for admin in admins:
                admin.flushdb()
                admin.close()
