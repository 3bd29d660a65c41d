"""Concurrency of one Valkey backend: its valkey-py calls run on a bounded executor (threads stay bounded over 10,000
calls, and end with ``close``), a call that finds no free thread in time times out without ever running, and a
call that times out drops its own connection only: the saver's command in flight on another connection completes.

Real servers (``dedicated_valkey``: one per test, so connection and blocked-client counts are this test's own); the
saver's connection is held still by a relay in front of the server (:class:`_HoldingRelay`) instead of by timing.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest
import valkey

from range_connector.backends.valkey.calls import CALL_WORKERS
from range_connector.backends.valkey.client import ValkeyBackend
from range_connector.errors import BackendTimeoutError
from tests.backends.conformance import MiB, make_stripe, read_whole

WIDE_S = 30.0  # a wait this long is a hang (nothing here takes more than a few seconds)
NUM_CALLS = 10_000
NUM_CALLERS = 4


def _wait_until(predicate: Callable[[], bool], timeout_s: float = WIDE_S) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


# ---------------------------------------------------------------------------------------------------- threads
@pytest.mark.timeout(240)
def test_ten_thousand_calls_keep_threads_bounded_and_close_ends_them(dedicated_valkey) -> None:
    url = dedicated_valkey.urls[0]
    baseline = set(threading.enumerate())
    # A budget: every write also runs the reservation script (valkey-py), besides its values (RESP path).
    backend = ValkeyBackend(url, timeout_s=WIDE_S, capacity_bytes=64 * MiB)
    seen: set[threading.Thread] = set()  # (holds the Thread objects, so none is counted twice)
    max_active = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal max_active
        while not stop.wait(0.0005):
            max_active = max(max_active, threading.active_count())
            seen.update(threading.enumerate())

    errors: list[BaseException] = []

    def caller(idx: int) -> None:
        try:
            stripe = make_stripe(idx, row_bytes=64)
            assert backend.write_stripe(stripe.write)
            for i in range(NUM_CALLS // NUM_CALLERS - 1):
                kind = i % 6
                if kind == 0:
                    backend.ping()
                elif kind == 1:
                    assert backend.get_tickets([k for k, _ in stripe.write.tickets])[0] is not None
                elif kind == 2:
                    backend.release([stripe.sid], backend.lease([stripe.sid], 5.0))  # (two calls)
                elif kind == 3:
                    assert read_whole(backend, stripe)[0] == stripe.values
                elif kind == 4:
                    assert backend.used_bytes() > 0
                else:  # a small stripe written (a reservation and its values) and dropped again
                    other = make_stripe(i, row_bytes=16)
                    assert backend.write_stripe(other.write)
                    backend.drop_stripes([other.sid])
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    sampler = threading.Thread(target=sample)
    sampler.start()
    callers = [threading.Thread(target=caller, args=(i,)) for i in range(NUM_CALLERS)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(WIDE_S * 4)
    stop.set()
    sampler.join(WIDE_S)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in callers)
    calls = backend.counters.round_trips
    assert calls >= NUM_CALLS  # (a write is two round trips, a lease and its release two calls)
    new_threads = {t for t in seen if t not in baseline} - {sampler, *callers}
    assert len(new_threads) <= CALL_WORKERS, sorted(t.name for t in new_threads)[:20]
    assert max_active <= len(baseline) + NUM_CALLERS + 1 + CALL_WORKERS
    backend.close()
    assert threading.active_count() == len(baseline), [t.name for t in threading.enumerate() if t not in baseline]


@pytest.mark.timeout(60)
def test_a_call_that_finds_no_free_thread_in_time_times_out_and_never_runs(dedicated_valkey) -> None:
    url = dedicated_valkey.urls[0]
    backend = ValkeyBackend(url, timeout_s=WIDE_S)
    admin = valkey.Valkey.from_url(url, socket_timeout=WIDE_S)
    keys = [f"conc:block:{i}" for i in range(CALL_WORKERS)]
    results: list[object] = [None] * CALL_WORKERS

    def block(i: int) -> None:  # holds one executor thread until the key gets a value
        results[i] = backend._call(1, lambda: backend._client.blpop([keys[i]], 0))

    blockers = [threading.Thread(target=block, args=(i,)) for i in range(CALL_WORKERS)]
    for t in blockers:
        t.start()
    try:
        assert _wait_until(lambda: int(admin.info("clients")["blocked_clients"]) == CALL_WORKERS)
        ran = threading.Event()
        with pytest.raises(BackendTimeoutError):
            backend._call(1, ran.set, deadline=time.monotonic() + 0.2)
    finally:
        for k in keys:
            admin.lpush(k, b"go")
        for t in blockers:
            t.join(WIDE_S)
    assert results == [(k.encode(), b"go") for k in keys]  # every blocked call completed on its connection
    backend.ping()  # the executor is free again; the call given up was cancelled, not run late
    assert not ran.is_set()
    backend.close()
    admin.close()


# ---------------------------------------------------------------------------------------------------- timeouts
@dataclass
class _Link:
    """One client connection through the relay."""

    request_bytes: int = 0
    carried_blpop: bool = False
    client_closed: bool = False


class _HoldingRelay:
    """A TCP relay to one Valkey server that forwards every connection both ways, except that it holds (stops
    forwarding) the requests of the first connection for which ``hold(chunk, request_bytes)`` is true, until
    :meth:`release`. It records per connection whether it carried a BLPOP and whether its client closed it."""

    def __init__(self, server_url: str, hold: Callable[[bytes, int], bool]) -> None:
        parsed = urlparse(server_url)
        self._target = (parsed.hostname, parsed.port)
        self._hold = hold
        self._armed = False
        self.links: list[_Link] = []
        self.held_link: _Link | None = None
        self.holding = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"valkey://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def arm(self) -> None:
        """From now on, hold the first connection that matches."""
        self._armed = True

    def release(self) -> None:
        self._released.set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(self._target)
            link = _Link()
            with self._lock:
                self.links.append(link)
                self._sockets += [client, upstream]
            for args in ((client, upstream, link, True), (upstream, client, link, False)):
                t = threading.Thread(target=self._pump, args=args, daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, link: _Link, requests: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    if requests:
                        link.client_closed = True
                    break
                if requests:
                    link.request_bytes += len(data)
                    if len(data) < 4096 and b"BLPOP" in data.upper():
                        link.carried_blpop = True
                    with self._lock:
                        hold = self._armed and self.held_link is None and self._hold(data, link.request_bytes)
                        if hold:
                            self.held_link = link
                    if hold:
                        self.holding.set()
                        self._released.wait(WIDE_S)
                dst.sendall(data)
        except OSError:
            if requests:
                link.client_closed = True
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._released.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
        for t in self._threads:
            t.join(WIDE_S)


def _values_past_1_mib(_chunk: bytes, request_bytes: int) -> bool:
    return request_bytes > MiB


def _reservation_script(chunk: bytes, _request_bytes: int) -> bool:
    return b"EVALSHA" in chunk.upper()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("held", ["values", "reservation"])
def test_a_timed_out_call_drops_its_own_connection_and_the_savers_write_completes(dedicated_valkey,
                                                                                  held: str) -> None:
    """Thread A (the saver) writes a 32 MiB stripe whose request is held at the relay mid-way: its stripe values
    (RESP path) or its budget reservation (a script: valkey-py, as B's call). Meanwhile B's BLPOP, which nobody
    answers, times out: B gets BackendTimeoutError and only B's connection is closed; A's write then completes and
    reads back byte-exact. (Before the executor, a timeout disconnected every valkey-py connection of the backend:
    the reservation case failed with A's write raising BackendError.)"""
    server_url = dedicated_valkey.urls[0]
    relay = _HoldingRelay(server_url, _values_past_1_mib if held == "values" else _reservation_script)
    admin = valkey.Valkey.from_url(server_url, socket_timeout=WIDE_S)
    backend = ValkeyBackend(relay.url, timeout_s=WIDE_S, capacity_bytes=256 * MiB if held == "reservation" else None)
    try:
        stripe = make_stripe(7, num_layers=2, row_bytes=2 * MiB)  # 2 layers of 16 MiB
        assert stripe.nbytes == 32 * MiB
        relay.arm()
        outcome: list[object] = []
        saver = threading.Thread(target=lambda: outcome.append(_outcome(backend.write_stripe, stripe.write)))
        saver.start()
        assert relay.holding.wait(WIDE_S)
        held_link = relay.held_link
        assert held_link is not None and not held_link.carried_blpop

        with pytest.raises(BackendTimeoutError):
            backend._call(1, lambda: backend._client.blpop([b"conc:nobody-pushes"], 0),
                          deadline=time.monotonic() + 0.3)
        blpop_links = [link for link in relay.links if link.carried_blpop]
        assert len(blpop_links) == 1
        assert _wait_until(lambda: blpop_links[0].client_closed)  # B's connection is dropped at once
        assert _wait_until(lambda: int(admin.info("clients")["blocked_clients"]) == 0)

        relay.release()
        saver.join(WIDE_S)
        assert outcome == [True]  # A's write was not disturbed
        assert read_whole(backend, stripe) == [stripe.values]
        assert [link for link in relay.links if link.client_closed] == blpop_links  # nothing else was closed
        assert not held_link.client_closed
    finally:
        relay.release()
        backend.close()
        admin.close()
        relay.close()


def _outcome(fn: Callable, *args: object) -> object:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test compares the outcome with the expected result
        return exc
