"""One conformance suite for the backend protocol (``range_connector.backends.base``), run against every backend.

:class:`BackendConformance` holds the contract; each backend subclasses it once and provides two fixtures:
``backend`` (an empty store) and ``limited_backend`` (an empty store whose ``max_value_bytes`` is ``LIMIT_BYTES``).
Backend-specific behaviour (Valkey deadlines and server-side command counts, DRAM eviction) lives in the
subclasses.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import valkey

from range_connector.backends.base import Backend
from range_connector.backends.memory import MemoryBackend
from range_connector.backends.valkey import ValkeyBackend
from range_connector.errors import BackendError, BackendTimeoutError

MiB = 1 << 20
LIMIT_BYTES = 1 * MiB  # Valkey's smallest accepted proto-max-bulk-len
ROUND_TRIP_SIZES = [0, 1, 7, 4096, 65_537, 1 * MiB, 8 * MiB]


def _random_bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _keys(n: int, prefix: bytes = b"k") -> list[bytes]:
    return [b"%s:%06d" % (prefix, i) for i in range(n)]


def _delta(backend: Backend, before: dict[str, int]) -> dict[str, int]:
    after = backend.counters.snapshot()
    return {name: after[name] - before[name] for name in after}


class _TricklingServer:
    """A fake Valkey server on loopback that answers the start-up handshake at once, then sends every GET reply
    one byte per ``interval_s``: it keeps answering, so no single socket read times out, but the call as a whole
    takes ``len(reply) * interval_s``."""

    GET_REPLY = b"$8\r\nslowslow\r\n"

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
                elif command == b"GET":
                    for byte in self.GET_REPLY:
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


class BackendConformance:
    """Contract tests every backend passes. Subclasses provide the ``backend`` and ``limited_backend`` fixtures."""

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        raise NotImplementedError

    @pytest.fixture
    def limited_backend(self) -> Iterator[Backend]:
        raise NotImplementedError

    # ------------------------------------------------------------------ round trips
    @pytest.mark.timeout(30)
    def test_round_trip_is_byte_exact(self, backend: Backend) -> None:
        items = [(b"size:%d" % size, _random_bytes(size, size)) for size in ROUND_TRIP_SIZES]

        backend.put_many(items)
        got = backend.get_many([key for key, _ in items])

        assert [len(v) if v is not None else None for v in got] == ROUND_TRIP_SIZES
        for (key, value), read in zip(items, got):
            assert read == value, key
            assert isinstance(read, bytes)

    @pytest.mark.timeout(10)
    def test_overwrite_returns_latest_value(self, backend: Backend) -> None:
        backend.put_many([(b"a", b"first value")])
        backend.put_many([(b"a", b"2nd")])

        assert backend.get_many([b"a"]) == [b"2nd"]

    @pytest.mark.timeout(10)
    def test_put_accepts_any_contiguous_buffer(self, backend: Backend) -> None:
        # The protocol's Buffer type: bytes, bytearray, and memoryviews of any format and shape (e.g. a view of
        # an int64 tensor, or a 2-D uint8 array). The stored value is the raw bytes.
        int64_view = memoryview(np.arange(16, dtype=np.int64))
        view_2d = memoryview(np.arange(32, dtype=np.uint8).reshape(4, 8))
        items = [
            (b"bytes", b"\x00\x01bytes"),
            (b"bytearray", bytearray(b"\x02bytearray")),
            (b"view", memoryview(b"\x03view")),
            (b"int64", int64_view),
            (b"2d", view_2d),
        ]

        backend.put_many(items)

        assert backend.get_many([key for key, _ in items]) == [bytes(v) for _, v in items]

    # ------------------------------------------------------------------ misses
    @pytest.mark.timeout(10)
    def test_missing_keys_are_misses_not_errors(self, backend: Backend) -> None:
        backend.put_many([(b"present", b"x")])

        assert backend.get_many([b"never-1", b"present", b"never-2"]) == [None, b"x", None]
        assert backend.lookup_prefix([b"never-1", b"present"]) == 0
        assert backend.delete_many([b"never-1"]) == 0
        assert backend.get_many([]) == []

    # ------------------------------------------------------------------ lookup_prefix
    @pytest.mark.timeout(10)
    @pytest.mark.parametrize(
        ("present", "expected"),
        [
            ([], 0),  # nothing stored
            ([0, 1, 2, 3, 4, 5, 6, 7], 8),  # all present
            ([0, 1, 2, 4, 5, 6, 7], 3),  # hole in the middle
            ([1, 2, 3, 4, 5, 6, 7], 0),  # first missing
            ([0, 1, 2, 3, 4, 5, 6], 7),  # last missing
        ],
    )
    def test_lookup_prefix_counts_leading_present_keys(
        self, backend: Backend, present: list[int], expected: int
    ) -> None:
        keys = _keys(8)
        if present:
            backend.put_many([(keys[i], b"v%d" % i) for i in present])

        assert backend.lookup_prefix(keys) == expected

    @pytest.mark.timeout(10)
    def test_lookup_prefix_of_no_keys_is_zero(self, backend: Backend) -> None:
        backend.put_many([(b"a", b"x")])
        before = backend.counters.snapshot()

        assert backend.lookup_prefix([]) == 0
        assert _delta(backend, before)["round_trips"] <= 1

    @pytest.mark.timeout(20)
    @pytest.mark.parametrize("num_keys", [1, 10, 320])
    @pytest.mark.parametrize("hole", [False, True])
    def test_lookup_prefix_is_one_round_trip(self, backend: Backend, num_keys: int, hole: bool) -> None:
        keys = _keys(num_keys)
        stored = [k for i, k in enumerate(keys) if not (hole and i == num_keys // 2)]
        if stored:
            backend.put_many([(k, b"v") for k in stored])
        before = backend.counters.snapshot()

        n = backend.lookup_prefix(keys)

        assert n == (num_keys // 2 if hole else num_keys)
        assert _delta(backend, before)["round_trips"] == 1

    # ------------------------------------------------------------------ batching
    @pytest.mark.timeout(20)
    @pytest.mark.parametrize("num_keys", [1, 10, 320])
    def test_put_many_and_get_many_are_one_round_trip_each(self, backend: Backend, num_keys: int) -> None:
        items = [(k, _random_bytes(i, 100 + i)) for i, k in enumerate(_keys(num_keys))]

        before = backend.counters.snapshot()
        backend.put_many(items)
        assert _delta(backend, before)["round_trips"] == 1

        before = backend.counters.snapshot()
        got = backend.get_many([k for k, _ in items])
        assert _delta(backend, before)["round_trips"] == 1
        assert got == [v for _, v in items]

        before = backend.counters.snapshot()
        assert backend.delete_many([k for k, _ in items]) == num_keys
        assert _delta(backend, before)["round_trips"] == 1

    # ------------------------------------------------------------------ size limit
    @pytest.mark.timeout(20)
    def test_value_over_max_value_bytes_raises_and_stores_nothing(self, limited_backend: Backend) -> None:
        assert limited_backend.max_value_bytes == LIMIT_BYTES
        items = [(b"small", b"s" * 10), (b"big", b"b" * (LIMIT_BYTES + 1)), (b"after", b"a")]

        with pytest.raises(ValueError, match=r"big.*1048577 bytes"):
            limited_backend.put_many(items)

        assert limited_backend.get_many([b"small", b"big", b"after"]) == [None, None, None]
        # The tier (and, for remote tiers, its connection pool) is healthy afterwards.
        limited_backend.put_many([(b"ok", b"fine")])
        assert limited_backend.get_many([b"ok"]) == [b"fine"]

    @pytest.mark.timeout(20)
    def test_value_of_exactly_max_value_bytes_is_accepted(self, limited_backend: Backend) -> None:
        value = _random_bytes(7, LIMIT_BYTES)

        limited_backend.put_many([(b"edge", value)])

        assert limited_backend.get_many([b"edge"]) == [value]

    # ------------------------------------------------------------------ delete
    @pytest.mark.timeout(10)
    def test_delete_many_returns_how_many_existed(self, backend: Backend) -> None:
        backend.put_many([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")])

        assert backend.delete_many([b"a", b"b", b"missing"]) == 2
        assert backend.get_many([b"a", b"b", b"c"]) == [None, None, b"3"]
        assert backend.delete_many([b"a"]) == 0
        assert backend.lookup_prefix([b"c", b"a"]) == 1

    # ------------------------------------------------------------------ counters
    @pytest.mark.timeout(10)
    def test_counters_count_bytes_read_and_written(self, backend: Backend) -> None:
        items = [(b"a", b"x" * 1000), (b"b", b""), (b"c", b"y" * 24)]

        before = backend.counters.snapshot()
        backend.put_many(items)
        written = _delta(backend, before)
        assert written["bytes_written"] == 1024
        assert written["bytes_read"] == 0
        assert written["commands"] == 3

        before = backend.counters.snapshot()
        backend.get_many([b"a", b"missing", b"c", b"b"])
        read = _delta(backend, before)
        assert read["bytes_read"] == 1024
        assert read["bytes_written"] == 0
        assert read["commands"] == 4

    @pytest.mark.timeout(10)
    def test_snapshot_is_a_plain_copy(self, backend: Backend) -> None:
        snap = backend.counters.snapshot()
        backend.put_many([(b"a", b"x")])

        assert snap != backend.counters.snapshot()
        assert set(snap) == {"round_trips", "commands", "bytes_written", "bytes_read", "allocations", "copy_launches"}

    # ------------------------------------------------------------------ concurrency
    @pytest.mark.timeout(60)
    def test_concurrent_readers_and_writers_are_byte_exact(self, backend: Backend) -> None:
        # 4 threads write versions of 16 shared keys and read them back. Every value read must be exactly one of
        # the values written for that key (never torn, truncated, or another key's value).
        num_threads, num_keys, num_rounds = 4, 16, 25
        keys = _keys(num_keys, b"shared")

        def value_of(key_idx: int, version: int) -> bytes:
            size = 1 + (key_idx * 7919 + version * 104_729) % 20_000
            return struct.pack("<II", key_idx, version) + _random_bytes(key_idx * 1_000_003 + version, size)

        errors: list[str] = []
        barrier = threading.Barrier(num_threads)

        def work(thread_idx: int) -> None:
            rng = random.Random(thread_idx)
            barrier.wait()
            for round_idx in range(num_rounds):
                mine = rng.sample(range(num_keys), 4)
                version = thread_idx * num_rounds + round_idx
                backend.put_many([(keys[i], value_of(i, version)) for i in mine])
                for key_idx, value in enumerate(backend.get_many(keys)):
                    if value is None:
                        continue
                    stored_key_idx, stored_version = struct.unpack_from("<II", value)
                    if stored_key_idx != key_idx or value != value_of(key_idx, stored_version):
                        errors.append(f"thread {thread_idx}: key {key_idx} read a bad value ({len(value)} bytes)")
                backend.lookup_prefix(keys)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=50)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        # Counters are not lost under concurrency: each round is exactly one put, one get and one lookup.
        assert backend.counters.round_trips == num_threads * num_rounds * 3


class TestMemoryBackend(BackendConformance):
    """The in-process DRAM tier (the reference implementation)."""

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        b = MemoryBackend(64 * MiB)
        yield b
        b.close()

    @pytest.fixture
    def limited_backend(self) -> Iterator[Backend]:
        b = MemoryBackend(64 * MiB, max_value_bytes=LIMIT_BYTES)
        yield b
        b.close()

    @pytest.mark.timeout(10)
    def test_capacity_eviction_is_lru_and_reported(self) -> None:
        b = MemoryBackend(300)
        b.put_many([(b"a", b"A" * 100), (b"b", b"B" * 100), (b"c", b"C" * 100)])
        assert b.used_bytes == 300
        assert b.take_evicted() == []
        assert b.get_many([b"a"]) == [b"A" * 100]  # a is now the most recently used

        b.put_many([(b"d", b"D" * 100)])

        assert b.get_many([b"a", b"b", b"c", b"d"]) == [b"A" * 100, None, b"C" * 100, b"D" * 100]
        assert b.take_evicted() == [b"b"]
        assert b.take_evicted() == []
        assert b.used_bytes == 300

    @pytest.mark.timeout(10)
    def test_lookup_prefix_refreshes_recency(self) -> None:
        b = MemoryBackend(300)
        b.put_many([(b"a", b"A" * 100), (b"b", b"B" * 100), (b"c", b"C" * 100)])
        assert b.lookup_prefix([b"a", b"b"]) == 2  # c is now the least recently used

        b.put_many([(b"d", b"D" * 150)])

        assert b.take_evicted() == [b"c", b"a"]
        assert b.lookup_prefix([b"b", b"d"]) == 2
        assert b.used_bytes == 250

    @pytest.mark.timeout(10)
    def test_overwrite_and_delete_keep_byte_accounting(self) -> None:
        b = MemoryBackend(1000)
        b.put_many([(b"a", b"x" * 400)])
        b.put_many([(b"a", b"y" * 100)])
        assert b.used_bytes == 100
        assert b.delete_many([b"a"]) == 1
        assert b.used_bytes == 0
        assert b.take_evicted() == []


class TestValkeyBackend(BackendConformance):
    """One shard on a real Valkey server (the session's shard-0 server, flushed around every test)."""

    @pytest.fixture
    def backend(self, valkey_servers) -> Iterator[Backend]:
        url = valkey_servers.urls[0]
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        admin.flushdb()
        b = ValkeyBackend(url, timeout_s=5.0)
        try:
            yield b
        finally:
            b.close()
            admin.flushdb()
            admin.close()

    @pytest.fixture
    def limited_backend(self, dedicated_valkey) -> Iterator[Backend]:
        # Lower the server's proto-max-bulk-len to 1 MiB; the backend reads it at construction.
        url = dedicated_valkey.urls[0]
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        original = admin.config_get("proto-max-bulk-len")["proto-max-bulk-len"]
        admin.config_set("proto-max-bulk-len", LIMIT_BYTES)
        b = ValkeyBackend(url, timeout_s=5.0)
        try:
            yield b
        finally:
            b.close()
            admin.config_set("proto-max-bulk-len", original)
            admin.close()

    @pytest.mark.timeout(10)
    def test_put_accepts_any_contiguous_buffer(self, backend: Backend) -> None:
        super().test_put_accepts_any_contiguous_buffer(backend)

    @pytest.mark.timeout(10)
    def test_max_value_bytes_is_the_server_limit(self, backend: Backend) -> None:
        admin = valkey.Valkey.from_url(backend.name)
        try:
            limit = int(admin.config_get("proto-max-bulk-len")["proto-max-bulk-len"])
        finally:
            admin.close()
        assert backend.max_value_bytes == limit
        assert backend.name == backend.url and backend.is_shared

    # ------------------------------------------------------------------ server-side command counts
    @pytest.mark.timeout(20)
    @pytest.mark.parametrize("num_keys", [1, 10, 320])
    def test_server_side_command_counts_match_client_counters(
        self, backend: Backend, server_commandstats: Callable[[str], dict[str, int]], num_keys: int
    ) -> None:
        url = backend.name
        keys = _keys(num_keys)
        # Half of the keys are absent: a GET of a missing key is still one command on the server.
        present = keys[: max(1, num_keys // 2)]

        def measure(call: Callable[[], object], command: str) -> tuple[int, int]:
            server_before = server_commandstats(url).get(command, 0)
            client_before = backend.counters.snapshot()
            call()
            server_calls = server_commandstats(url).get(command, 0) - server_before
            delta = _delta(backend, client_before)
            assert delta["round_trips"] == 1
            return server_calls, delta["commands"]

        assert measure(lambda: backend.put_many([(k, b"v") for k in present]), "set") == (len(present),) * 2
        assert measure(lambda: backend.get_many(keys), "get") == (num_keys, num_keys)
        assert measure(lambda: backend.lookup_prefix(keys), "exists") == (num_keys, num_keys)
        # DEL k1 k2 ... is one command, however many keys.
        assert measure(lambda: backend.delete_many(keys), "del") == (1, 1)

    # ------------------------------------------------------------------ deadlines and failures
    @pytest.mark.timeout(30)
    def test_frozen_server_raises_timeout_within_the_deadline(self, dedicated_valkey) -> None:
        url, pid = dedicated_valkey.urls[0], dedicated_valkey.pids[0]
        timeout_s = 0.5
        b = ValkeyBackend(url, timeout_s=timeout_s)
        b.put_many([(b"a", b"before")])
        calls: list[tuple[str, Callable[[], object]]] = [
            ("get_many", lambda: b.get_many([b"a"])),
            ("lookup_prefix", lambda: b.lookup_prefix([b"a"])),
            ("put_many", lambda: b.put_many([(b"z", b"x" * 1000)])),
        ]
        os.kill(pid, signal.SIGSTOP)
        try:
            for name, call in calls:
                start = time.monotonic()
                with pytest.raises(BackendTimeoutError, match=url) as exc_info:
                    call()
                elapsed_s = time.monotonic() - start
                assert elapsed_s < timeout_s + 1.0, (name, elapsed_s)
                assert isinstance(exc_info.value, BackendError) and isinstance(exc_info.value, TimeoutError)
        finally:
            os.kill(pid, signal.SIGCONT)
        # Once the server answers again the pool is usable, and no stale reply from a timed-out call is read
        # as the answer to a new one.
        for _ in range(3):
            assert b.get_many([b"a", b"missing"]) == [b"before", None]
        assert b.lookup_prefix([b"a"]) == 1
        b.close()

    @pytest.mark.timeout(20)
    def test_trickling_server_raises_timeout_within_the_deadline(self) -> None:
        # C21: one key answers after a very long delay. Each byte arrives within the socket timeout, so only a
        # per-call deadline catches it.
        timeout_s = 0.3
        server = _TricklingServer(interval_s=timeout_s / 2)
        try:
            b = ValkeyBackend(server.url, timeout_s=timeout_s)
            start = time.monotonic()
            try:
                with pytest.raises(BackendTimeoutError, match=server.url):
                    b.get_many([b"slow"])
            finally:
                elapsed_s = time.monotonic() - start
                b.close()
            assert elapsed_s < timeout_s + 1.0
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
        assert time.monotonic() - start < 2.0

    @pytest.mark.timeout(20)
    def test_oversize_write_against_a_stale_limit_fails_cleanly(self, dedicated_valkey) -> None:
        # C19: the limit was read at start-up and the server's was lowered later. The oversize write must fail
        # with a typed error (not hang), and the connection pool must stay healthy.
        url = dedicated_valkey.urls[0]
        b = ValkeyBackend(url, timeout_s=2.0)
        admin = valkey.Valkey.from_url(url, socket_timeout=5.0)
        original = admin.config_get("proto-max-bulk-len")["proto-max-bulk-len"]
        admin.config_set("proto-max-bulk-len", LIMIT_BYTES)
        try:
            start = time.monotonic()
            with pytest.raises((BackendError, ValueError)):
                b.put_many([(b"big", b"b" * (2 * LIMIT_BYTES))])
            assert time.monotonic() - start < 2.5
            assert admin.exists(b"big") == 0
            b.put_many([(b"ok", b"fine")])
            assert b.get_many([b"ok", b"big"]) == [b"fine", None]
        finally:
            admin.config_set("proto-max-bulk-len", original)
            admin.close()
            b.close()

    @pytest.mark.timeout(20)
    def test_backends_on_two_shard_servers_are_independent(self, valkey_servers) -> None:
        b0, b1 = (ValkeyBackend(url, timeout_s=5.0) for url in valkey_servers.urls[:2])
        try:
            b0.put_many([(b"indep:x", b"zero")])
            assert b1.get_many([b"indep:x"]) == [None]
            assert b0.get_many([b"indep:x"]) == [b"zero"]
            assert b0.delete_many([b"indep:x"]) == 1
        finally:
            b0.close()
            b1.close()
