"""RespConnection / RespPool against a real Valkey server (and two fake servers for trickling and garbage replies).

Servers come from the ``valkey_servers`` (shared, never frozen) and ``dedicated_valkey`` (this test only)
fixtures of ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import pytest
import xxhash

from range_connector.backends.base import ScatterDest
from range_connector.backends.valkey.pool import RespPool
from range_connector.backends.valkey.resp import RespCommandError, RespConnection, RespReplyTooLargeError
from range_connector.errors import BackendError, BackendTimeoutError
from range_connector.worker.direct_receive import WriteGate

MiB = 1 << 20
WIDE_S = 10.0  # a call or a thread that takes this long hangs (the deadlines here are at most 1 s)


def _address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 6379


def _deadline(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def conn(valkey_servers) -> Iterator[RespConnection]:
    connection = RespConnection(*_address(valkey_servers.urls[0]), timeout_s=10.0)
    try:
        yield connection
    finally:
        connection.close()


@pytest.mark.timeout(30)
def test_set_16mib_memoryview_then_get_into_bytearray_slice_is_byte_exact(conn: RespConnection) -> None:
    payload = random.Random(1).randbytes(16 * MiB)
    source = bytearray(b"\xaa" * 100) + payload  # the value is a slice of a larger buffer
    dest = bytearray(b"\x55" * (16 * MiB + 200))

    assert conn.execute_into([[b"SET", b"resp:big", memoryview(source)[100:]]], [None], deadline_s=_deadline()) == [0]
    lengths = conn.execute_into([[b"GET", b"resp:big"]], [memoryview(dest)[64:]], deadline_s=_deadline())

    assert lengths == [16 * MiB]
    assert dest[64 : 64 + 16 * MiB] == payload
    assert dest[:64] == b"\x55" * 64 and dest[64 + 16 * MiB :] == b"\x55" * 136
    assert (conn.round_trips, conn.commands_sent) == (2, 2)


@pytest.mark.timeout(30)
def test_getrange_at_odd_offsets_lands_in_dests(conn: RespConnection) -> None:
    value = random.Random(2).randbytes(3 * MiB + 7)
    conn.execute_into([[b"SET", b"resp:ranged", value]], [None], deadline_s=_deadline())
    ranges = [(1, 1), (3, 65_539), (1_000_001, 2_500_003), (3 * MiB, 3 * MiB + 6)]  # inclusive ends
    dest = bytearray(sum(end - start + 1 for start, end in ranges))
    views, offset = [], 0
    for start, end in ranges:
        views.append(memoryview(dest)[offset : offset + end - start + 1])
        offset += end - start + 1

    lengths = conn.execute_into(
        [[b"GETRANGE", b"resp:ranged", start, end] for start, end in ranges], views, deadline_s=_deadline()
    )

    assert lengths == [end - start + 1 for start, end in ranges]
    assert bytes(dest) == b"".join(value[start : end + 1] for start, end in ranges)


@pytest.mark.timeout(30)
def test_missing_key_is_nil_and_leaves_dest_untouched(conn: RespConnection) -> None:
    dest = bytearray(b"\x11" * 32)

    lengths = conn.execute_into(
        [[b"GET", b"resp:missing"], [b"GETRANGE", b"resp:missing", 0, 9]],
        [memoryview(dest), None],
        deadline_s=_deadline(),
    )

    assert lengths == [-1, 0]  # GETRANGE of a missing key is an empty string, not nil
    assert dest == b"\x11" * 32


def _scatter(buffer: bytearray, sizes: list[int], order: list[int]) -> tuple[memoryview, ...]:
    """Pieces of ``sizes`` bytes carved out of ``buffer`` in the positions ``order`` (piece i is the order[i]-th
    slot), so that consecutive pieces are not adjacent in memory (as KV rows of shuffled blocks)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    slots = sorted(range(len(sizes)), key=lambda i: order[i])
    pos, where = 0, {}
    for i in slots:
        where[i] = pos
        pos += sizes[i]
    view = memoryview(buffer)
    assert pos <= len(buffer) and len(starts) == len(sizes)
    return tuple(view[where[i]:where[i] + sizes[i]] for i in range(len(sizes)))


class _CountingGate:
    """A gate that counts its entries and refuses from entry ``refuse_at`` on (``None``: never)."""

    def __init__(self, refuse_at: int | None = None) -> None:
        self.entries = 0
        self.refuse_at = refuse_at

    def __enter__(self) -> None:
        if self.refuse_at is not None and self.entries >= self.refuse_at:
            raise BackendError("gate closed")
        self.entries += 1

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.mark.timeout(30)
def test_scatter_dest_receives_a_reply_across_pieces_and_leaves_the_next_reply_intact(conn: RespConnection) -> None:
    rng = random.Random(3)
    payload = rng.randbytes(16 * MiB + 5)
    sizes = [1, 7, 65_536, 3 * MiB + 1] + [MiB] * 12 + [16 * MiB + 5 - (1 + 7 + 65_536 + 3 * MiB + 1 + 12 * MiB)]
    order = list(range(len(sizes)))
    rng.shuffle(order)
    buffer = bytearray(b"\x5a" * (16 * MiB + 5))
    gate = _CountingGate()
    small = bytearray(5)
    conn.execute_into([[b"SET", b"resp:scatter", payload], [b"SET", b"resp:after", b"after"]], [None, None],
                      deadline_s=_deadline())

    digest = xxhash.xxh3_64()
    lengths = conn.execute_into([[b"GET", b"resp:scatter"], [b"GET", b"resp:after"]],
                                [ScatterDest(_scatter(buffer, sizes, order), gate, digest), memoryview(small)],
                                deadline_s=_deadline())

    assert lengths == [16 * MiB + 5, 5]
    assert b"".join(bytes(p) for p in _scatter(buffer, sizes, order)) == payload
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(payload)  # computed as the bytes landed
    assert small == b"after"  # the next reply was neither eaten nor shifted
    assert gate.entries >= 1
    # A reply shorter than its scatter destination fills the first bytes and stops there.
    buffer2 = bytearray(b"\x5a" * 100)
    pieces = (memoryview(buffer2)[50:], memoryview(buffer2)[:50])
    lengths = conn.execute_into([[b"GETRANGE", b"resp:scatter", 0, 59], [b"GET", b"resp:after"]],
                                [ScatterDest(pieces, gate), memoryview(small)], deadline_s=_deadline())
    assert lengths == [60, 5] and small == b"after"
    assert bytes(pieces[0]) + bytes(pieces[1][:10]) == payload[:60] and bytes(pieces[1][10:]) == b"\x5a" * 40
    assert not conn.closed


@pytest.mark.timeout(30)
def test_scatter_dest_of_many_small_pieces_beyond_one_receive_window(conn: RespConnection) -> None:
    # 400 rows of 64 KiB (25 MiB): more pieces than one recvmsg_into is offered (resp._SCATTER_RECV_BYTES).
    rng = random.Random(4)
    payload = rng.randbytes(400 * 65_536)
    order = list(range(400))
    rng.shuffle(order)
    buffer = bytearray(len(payload))
    pieces = _scatter(buffer, [65_536] * 400, order)
    conn.execute_into([[b"SET", b"resp:rows", payload]], [None], deadline_s=_deadline())
    digest = xxhash.xxh3_64()
    assert conn.execute_into([[b"GET", b"resp:rows"]], [ScatterDest(pieces, _CountingGate(), digest)],
                             deadline_s=_deadline()) == [len(payload)]
    assert b"".join(bytes(p) for p in pieces) == payload
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(payload)


@pytest.mark.timeout(30)
def test_scatter_gate_refusal_ends_the_read_closes_the_connection_and_writes_nothing_after(
        conn: RespConnection) -> None:
    payload = random.Random(4).randbytes(32 * MiB)
    conn.execute_into([[b"SET", b"resp:refused", payload]], [None], deadline_s=_deadline())
    buffer = bytearray(b"\x00" * (32 * MiB))
    pieces = tuple(memoryview(buffer)[i * MiB:(i + 1) * MiB] for i in range(32))
    gate = _CountingGate(refuse_at=2)

    with pytest.raises(BackendError, match="gate closed"):
        conn.execute_into([[b"GET", b"resp:refused"]], [ScatterDest(pieces, gate)], deadline_s=_deadline())

    assert conn.closed and gate.entries == 2
    # What landed is a prefix of the value, written by the two admitted entries; nothing after the refusal.
    landed = next((i for i, (x, y) in enumerate(zip(buffer, payload)) if x != y), len(payload))
    assert 0 < landed < len(payload)
    assert buffer[landed:] == b"\x00" * (len(payload) - landed)


@pytest.mark.timeout(30)
def test_scatter_waits_for_bytes_outside_the_gate_so_closing_it_never_waits_for_the_tier() -> None:
    # A trickling server: the reader spends most of its time waiting for bytes; the owner closes the gate meanwhile
    # and must not wait for the next chunk to arrive. The read then ends at its next write attempt. (The server sends
    # two chunks, then nothing until the test lets it: a close that waited for the tier would never return.)
    reply = b"$64\r\n" + bytes(range(1, 65)) + b"\r\n"  # no zero byte: what landed is told from what did not
    server = _FakeServer(reply, chunk_bytes=20, interval_s=0.0, hold_after_chunks=2)
    conn = RespConnection("127.0.0.1", server.port, timeout_s=60.0)  # (neither timeout is what ends the read)
    gate = WriteGate()
    buffer = bytearray(64)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            conn.execute_into([[b"GET", b"k"]], [ScatterDest((memoryview(buffer),), gate)], deadline_s=_deadline(60))
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    reader = threading.Thread(target=read)
    try:
        reader.start()
        end = time.monotonic() + WIDE_S
        # The first chunk's payload has landed (whether the second lands too depends on when the reader's first
        # receive ran: it then waits in poll for SO_RCVLOWAT bytes, which the held server never sends).
        while buffer[0] == 0:
            assert time.monotonic() < end, "the first chunk never landed"
            time.sleep(0.005)
        closer = threading.Thread(target=gate.close, daemon=True)
        closer.start()
        closer.join(WIDE_S)
        assert not closer.is_alive(), "closing the gate waited for the tier"
        landed = bytes(buffer)
        server.go_on.set()  # the third chunk arrives: the read tries to write it and ends
        reader.join(WIDE_S)
        assert not reader.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], BackendError) and "cancelled" in str(errors[0])
        num_landed = next(i for i, (x, y) in enumerate(zip(landed + b"\xff", range(1, 66))) if x != y)
        assert 0 < num_landed < 64 and landed[num_landed:] == bytes(64 - num_landed)
        assert bytes(buffer) == landed  # nothing landed after the gate closed
        assert conn.closed
    finally:
        conn.close()
        server.close()


@pytest.mark.timeout(30)
def test_mget_and_small_commands_via_execute(conn: RespConnection) -> None:
    conn.execute([[b"DEL", b"resp:m1", b"resp:m2"], [b"SET", b"resp:m1", b"one"], [b"SET", b"resp:m2", b""]])

    replies = conn.execute(
        [[b"MGET", b"resp:m1", b"resp:missing", b"resp:m2"], [b"EXISTS", b"resp:m1", b"resp:m2"], [b"PING"]]
    )

    assert replies == [[b"one", None, b""], 2, "PONG"]


@pytest.mark.timeout(30)
def test_error_reply_raises_after_the_whole_pipeline_and_connection_stays_in_sync(conn: RespConnection) -> None:
    conn.execute([[b"DEL", b"resp:list"], [b"RPUSH", b"resp:list", b"x"], [b"SET", b"resp:str", b"after"]])
    dest = bytearray(16)

    with pytest.raises(RespCommandError, match="WRONGTYPE") as info:
        conn.execute_into(
            [[b"GET", b"resp:list"], [b"GET", b"resp:str"]],
            [memoryview(dest), memoryview(dest)[8:]],
            deadline_s=_deadline(),
        )

    assert [idx for idx, _ in info.value.errors] == [0]
    assert info.value.results == [None, 5]
    assert dest[8:13] == b"after"  # the reply after the error was still read
    assert not conn.closed
    assert conn.execute([[b"GET", b"resp:str"], [b"PING"]]) == [b"after", "PONG"]
    with pytest.raises(RespCommandError, match="unknown command"):
        conn.execute([[b"NOSUCHCOMMAND"], [b"PING"]])
    assert conn.execute([[b"PING"]]) == ["PONG"]


@pytest.mark.timeout(30)
def test_dest_too_small_raises_and_pool_reconnects(valkey_servers) -> None:
    pool = RespPool(*_address(valkey_servers.urls[0]), timeout_s=10.0)
    try:
        with pool.connection() as conn:
            conn.execute([[b"SET", b"resp:hundred", b"h" * 100]])
            with pytest.raises(RespReplyTooLargeError, match="100 bytes"):
                conn.execute_into([[b"GET", b"resp:hundred"]], [memoryview(bytearray(99))], deadline_s=_deadline())
            assert conn.closed
            with pytest.raises(BackendError, match="closed"):
                conn.execute([[b"PING"]])
        with pool.connection() as fresh:
            assert fresh is not conn
            dest = bytearray(100)
            assert fresh.execute_into([[b"GET", b"resp:hundred"]], [memoryview(dest)], deadline_s=_deadline()) == [100]
        assert (pool.round_trips, pool.commands_sent) == (3, 3)  # nothing is sent on a closed connection
    finally:
        pool.close()


@pytest.mark.timeout(30)
def test_pool_serves_two_threads(valkey_servers) -> None:
    pool = RespPool(*_address(valkey_servers.urls[0]), timeout_s=10.0, max_connections=2)
    values = {b"resp:t%d" % i: os.urandom(MiB) for i in range(8)}
    errors: list[BaseException] = []

    def worker(keys: list[bytes]) -> None:
        try:
            dest = bytearray(MiB)
            for key in keys:
                with pool.connection() as conn:
                    conn.execute_into([[b"SET", key, values[key]]], [None], deadline_s=_deadline())
                    assert conn.execute_into([[b"GET", key]], [memoryview(dest)], deadline_s=_deadline()) == [MiB]
                assert dest == values[key]
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    keys = sorted(values)
    threads = [threading.Thread(target=worker, args=(keys[i::2],)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert not errors, errors
        assert (pool.round_trips, pool.commands_sent) == (16, 16)
    finally:
        pool.close()


@pytest.mark.timeout(30)
def test_frozen_server_raises_timeout_within_deadline(dedicated_valkey) -> None:
    host, port = _address(dedicated_valkey.urls[0])
    pid = dedicated_valkey.pids[0]
    reader = RespConnection(host, port, timeout_s=5.0)
    writer = RespConnection(host, port, timeout_s=5.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(BackendTimeoutError, match=f"{host}:{port}"):
            reader.execute_into([[b"GET", b"k"]], [memoryview(bytearray(8))], deadline_s=started + 1.0)
        assert 1.0 <= time.monotonic() - started < WIDE_S  # at the deadline: not before, and no hang
        assert reader.closed

        started = time.monotonic()  # a large SET blocks in send once the socket buffers are full
        with pytest.raises(BackendTimeoutError):
            writer.execute_into([[b"SET", b"k", memoryview(bytearray(64 * MiB))]], [None], deadline_s=started + 1.0)
        assert 1.0 <= time.monotonic() - started < WIDE_S
        assert writer.closed
    finally:
        os.kill(pid, signal.SIGCONT)
        reader.close()
        writer.close()


class _FakeServer:
    """A loopback server that answers every request with ``reply``, one chunk per ``interval_s``; with
    ``hold_after_chunks``, the chunks after that many only once :attr:`go_on` is set."""

    def __init__(self, reply: bytes, chunk_bytes: int, interval_s: float, hold_after_chunks: int | None = None) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._reply, self._chunk_bytes, self._interval_s = reply, chunk_bytes, interval_s
        self._hold_after = hold_after_chunks
        self.go_on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with self._listener, self._listener.accept()[0] as client:
            client.recv(65536)
            for idx, offset in enumerate(range(0, len(self._reply), self._chunk_bytes)):
                if idx == self._hold_after:
                    while not self.go_on.wait(0.01):
                        if self._stop.is_set():
                            return
                if self._stop.wait(self._interval_s):
                    return
                client.sendall(self._reply[offset : offset + self._chunk_bytes])
            self._stop.wait(5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.timeout(30)
def test_trickling_reply_cannot_stretch_the_deadline() -> None:
    server = _FakeServer(b"$8\r\nslowslow\r\n", chunk_bytes=1, interval_s=0.5)  # 14 bytes: 7 s in all
    conn = RespConnection("127.0.0.1", server.port, timeout_s=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(BackendTimeoutError, match="no complete reply"):
            conn.execute_into([[b"GET", b"k"]], [memoryview(bytearray(8))], deadline_s=started + 1.0)
        assert 1.0 <= time.monotonic() - started < WIDE_S  # at the deadline, long before the reply
    finally:
        conn.close()
        server.close()


@pytest.mark.timeout(30)
def test_garbage_reply_raises_backend_error_and_closes() -> None:
    server = _FakeServer(b"?what\r\n", chunk_bytes=64, interval_s=0.0)
    conn = RespConnection("127.0.0.1", server.port, timeout_s=5.0)
    try:
        with pytest.raises(BackendError, match=f"127.0.0.1:{server.port}.*unexpected reply type"):
            conn.execute([[b"PING"]])
        assert conn.closed
    finally:
        conn.close()
        server.close()


@pytest.mark.timeout(30)
def test_closed_port_raises_backend_error_naming_the_server() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free once the probe closes

    with pytest.raises(BackendError, match=f"127.0.0.1:{port}"):
        RespConnection("127.0.0.1", port, timeout_s=2.0)


@pytest.mark.timeout(30)
def test_server_command_count_equals_commands_sent(
    conn: RespConnection, valkey_servers, server_commandstats: Callable[[str], dict[str, int]]
) -> None:
    url = valkey_servers.urls[0]
    names = ("set", "get", "getrange", "mget", "exists", "del")
    before = server_commandstats(url)
    dest = bytearray(4 * MiB)
    keys = [b"resp:count:%d" % i for i in range(20)]

    conn.execute_into([[b"SET", key, memoryview(dest)[: 1000 * i]] for i, key in enumerate(keys)],
                      [None] * 20, deadline_s=_deadline())
    conn.execute_into([[b"GET", key] for key in keys] + [[b"GETRANGE", keys[5], 1, 100]],
                      [memoryview(dest)] * 21, deadline_s=_deadline())
    conn.execute([[b"MGET", *keys[:3]], [b"EXISTS", *keys], [b"DEL", *keys]])

    after = server_commandstats(url)
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in names}
    assert delta == {"set": 20, "get": 20, "getrange": 1, "mget": 1, "exists": 1, "del": 1}
    assert sum(delta.values()) == conn.commands_sent == 44
    assert conn.round_trips == 3
