"""File tier (:class:`range_connector.backends.file.backend.FileBackend`): byte-exact ranged reads, misses, the byte
budget measured on the real files (C17), leases, several processes sharing one directory, deadlines, O_DIRECT.

The protocol contract itself is also checked by the conformance suite (``test_conformance_*.py``); this file covers
what only a file tier has (its ticket log: ``test_file_ticket_log.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import filelock
import pytest
import xxhash

from range_connector.backends.base import RangeRead, ScatterDest, StripeWrite
from range_connector.backends.file.backend import FileBackend, gds_status
from range_connector.backends.file.stripes import PAGE, DeviceRead
from range_connector.errors import BackendError, BackendTimeoutError
from tests.filesystems import odirect_refusal

REPO_ROOT = Path(__file__).resolve().parents[2]


def _bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _stripe(sid: str, num_layers: int, layer_bytes: int, num_chunks: int = 2, seed: int = 0) -> StripeWrite:
    values = [_bytes(seed * 1000 + layer, layer_bytes) for layer in range(num_layers)]
    tickets = [(f"{sid}:chunk{c}".encode(), f"ticket {sid} {c}".encode()) for c in range(num_chunks)]
    return StripeWrite(sid, values, tickets)


def _read(backend: FileBackend, sid: str, layer: int, offset: int, length: int,
          value_bytes: int | None = None) -> tuple[bool, bytes]:
    """One ranged read (``value_bytes``, what the ticket claims: by default just enough for the range)."""
    dest = bytearray(length)
    value_bytes = offset + length if value_bytes is None else value_bytes
    ok = backend.read_ranges([RangeRead(sid, layer, offset, length, value_bytes, memoryview(dest))])
    return ok[0], bytes(dest)


def _stripe_bytes_on_disk(root: Path) -> int:
    """Bytes of layer values on disk, measured on the files: every stripe file (published or being written) less
    its 4096-byte header page. The ticket log and the empty lease files are metadata outside the budget."""
    total = 0
    for entry in os.scandir(root / "stripes"):
        with contextlib.suppress(FileNotFoundError):
            total += max(0, entry.stat(follow_symlinks=False).st_size - PAGE)
    return total


def _metadata_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "tickets").iterdir()) + PAGE * len(os.listdir(root / "stripes"))


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[FileBackend]:
    b = FileBackend(tmp_path / "shard0", timeout_s=10.0)
    yield b
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_odirect", [False, True])
def test_round_trip_is_byte_exact_with_odd_ranges(tmp_path: Path, use_odirect: bool) -> None:
    if use_odirect and (reason := odirect_refusal(tmp_path)):
        pytest.skip(reason)
    b = FileBackend(tmp_path / "s", use_odirect=use_odirect)
    layer_bytes = 3 * PAGE + 123  # not a multiple of the page: padded under O_DIRECT, back to back otherwise
    w = _stripe("abc1", 5, layer_bytes, seed=1)
    other = _stripe("abc2", 2, 77, seed=2)
    assert b.write_stripe(w) and b.write_stripe(other)
    ranges = [("abc1", 0, 0, layer_bytes), ("abc1", 4, 0, layer_bytes), ("abc1", 2, 1, 1), ("abc1", 2, PAGE - 1, 2),
              ("abc1", 3, layer_bytes - 1, 1), ("abc1", 1, 4097, 5000), ("abc1", 1, 4097, 5000),
              ("abc2", 1, 3, 70), ("abc2", 0, 0, 77)]
    dests = [bytearray(n) for *_, n in ranges]
    reads = [RangeRead(s, layer, off, n, layer_bytes if s == "abc1" else 77, memoryview(d))
             for (s, layer, off, n), d in zip(ranges, dests)]
    assert b.read_ranges(reads) == [True] * len(reads)
    for (sid, layer, off, n), dest in zip(ranges, dests):
        source = (w if sid == "abc1" else other).layer_values[layer]
        assert bytes(dest) == source[off:off + n], (sid, layer, off, n)
    assert b.get_tickets([k for k, _ in w.tickets]) == [t for _, t in w.tickets]
    assert b.direct_reads == use_odirect  # (the O_DIRECT reads were not given up on the way)
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_odirect", [False, True])
def test_scatter_reads_over_several_system_calls_land_byte_exact_with_their_digest(tmp_path: Path,
                                                                                  use_odirect: bool) -> None:
    # A whole layer of 20 MiB + 7 bytes: more than one scatter system call (8 MiB each), pieces of odd sizes placed
    # out of order, next to an ordinary read of the same stripe in the same call.
    if use_odirect and (reason := odirect_refusal(tmp_path)):
        pytest.skip(reason)
    b = FileBackend(tmp_path / "s", use_odirect=use_odirect)
    layer_bytes = (20 << 20) + 7
    w = _stripe("big1", 2, layer_bytes, seed=5)
    assert b.write_stripe(w)
    sizes = [1, PAGE - 1, (9 << 20) + 3, 5]
    sizes.append(layer_bytes - sum(sizes))
    buf = bytearray(layer_bytes)
    view = memoryview(buf)
    starts = [layer_bytes - sizes[0], 0]  # piece 0 at the end of the buffer, the rest from its start
    for n in sizes[1:-1]:
        starts.append(starts[-1] + n)
    pieces = tuple(view[a:a + n] for a, n in zip(starts, sizes))
    entered = []
    gate = contextlib.nullcontext()

    class Counting:
        def __enter__(self) -> None:
            entered.append(1)
            gate.__enter__()

        def __exit__(self, *exc: object) -> None:
            gate.__exit__(*exc)

    digest = xxhash.xxh3_64()
    plain = bytearray(100)
    reads = [RangeRead("big1", 1, 0, layer_bytes, layer_bytes, ScatterDest(pieces, Counting(), digest)),
             RangeRead("big1", 0, 12345, 100, layer_bytes, memoryview(plain))]
    assert b.read_ranges(reads) == [True, True]
    assert b"".join(bytes(p) for p in pieces) == bytes(w.layer_values[1])
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(w.layer_values[1])
    assert bytes(plain) == bytes(w.layer_values[0][12345:12445])
    assert len(entered) >= 3  # the gate is entered per system call, not once around the whole read
    b.close()


@pytest.mark.timeout(60)
def test_any_contiguous_buffer_is_accepted(backend: FileBackend) -> None:
    values = [memoryview(bytearray(_bytes(3, 4096))).cast("I", (32, 32)), _bytes(4, 4096)]
    assert backend.write_stripe(StripeWrite("typed", values, []))
    dest = memoryview(bytearray(4096)).cast("Q")
    assert backend.read_ranges([RangeRead("typed", 0, 0, 4096, 4096, dest)]) == [True]
    assert dest.tobytes() == values[0].tobytes()


@pytest.mark.timeout(60)
def test_missing_stripe_layer_and_ticket_are_misses(backend: FileBackend) -> None:
    assert backend.write_stripe(_stripe("here", 2, 100))
    dest = memoryview(bytearray(10))
    reads = [RangeRead(sid, layer, 0, 10, 100, dest) for sid, layer in
             [("gone", 0), ("here", 2), ("here", -1), ("../here", 0), ("here", 1)]]
    assert backend.read_ranges(reads) == [False, False, False, False, True]
    assert backend.get_tickets([b"nope", b"here:chunk0"]) == [None, b"ticket here 0"]
    assert backend.read_ranges([]) == []


@pytest.mark.timeout(60)
def test_read_outside_the_value_raises(backend: FileBackend) -> None:
    assert backend.write_stripe(_stripe("s", 2, 100))
    for off, n, claimed in [(95, 10, 100), (-1, 2, 100), (100, 1, 100), (0, 0, 100), (150, 10, 200), (0, 101, 101)]:
        with pytest.raises(ValueError, match="outside"):  # the last two: a ticket that claims more than is stored
            backend.read_ranges([RangeRead("s", 1, off, n, claimed, memoryview(bytearray(max(0, n))))])
    with pytest.raises(ValueError):  # dest of the wrong size
        backend.read_ranges([RangeRead("s", 1, 0, 10, 100, memoryview(bytearray(11)))])
    assert _read(backend, "s", 1, 0, 100) == (True, _stripe("s", 2, 100).layer_values[1])


@pytest.mark.timeout(120)
def test_c17_cap_is_never_exceeded_over_200_save_and_removal_cycles(tmp_path: Path) -> None:
    """C17: saves and removals by every path (eviction, delete_tickets, a person deleting stripe files) until far
    more than the cap was written: saves keep succeeding, the accounting equals the files, and the stripe bytes on
    disk never exceed the cap (sampled between the tier's critical sections, from outside, as another process)."""
    root = tmp_path / "shard"
    cap = 256 * 1024
    b = FileBackend(root, cap, timeout_s=10.0)
    rng = random.Random(17)
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        lock = filelock.FileLock(str(root / "lock"), preserve_lock_file=True)
        while not stop.is_set():
            with lock:
                samples.append(_stripe_bytes_on_disk(root))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    written = 0
    try:
        for i in range(200):
            w = _stripe(f"s{i}", rng.randint(1, 6), rng.randint(1, 12_000), num_chunks=rng.randint(0, 20), seed=i)
            assert b.write_stripe(w), f"save {i} skipped"
            written += w.nbytes
            on_disk = _stripe_bytes_on_disk(root)
            assert on_disk <= cap
            assert b.used_bytes() == on_disk
            if i % 13 == 0:
                assert _read(b, f"s{i}", 0, 0, 1)[0]
            if i % 7 == 3:
                b.delete_tickets([k for k, _ in w.tickets[:3]])
            if i % 11 == 5:  # removed behind the tier's back
                victims = sorted(p for p in (root / "stripes").iterdir() if p.name.isalnum())[:1]
                for p in victims:
                    p.unlink()
    finally:
        stop.set()
        sampler.join(timeout=10)
    assert written > 10 * cap
    assert samples and max(samples) <= cap
    assert b.used_bytes() == _stripe_bytes_on_disk(root)
    assert _metadata_bytes(root) < 1 << 20  # the ticket log and the header pages stay small
    b.close()


@pytest.mark.timeout(120)
def test_c17_two_writers_on_one_root_never_exceed_the_cap(tmp_path: Path) -> None:
    root = tmp_path / "shard"
    cap = 200 * 1024
    backends = [FileBackend(root, cap, timeout_s=20.0) for _ in range(2)]
    failures: list[BaseException] = []
    samples: list[int] = []
    stop = threading.Event()

    def write(idx: int) -> None:
        try:
            for i in range(40):
                assert backends[idx].write_stripe(_stripe(f"w{idx}x{i}", 3, 9_000, num_chunks=8, seed=i))
                assert backends[idx].used_bytes() <= cap
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    def sample() -> None:
        lock = filelock.FileLock(str(root / "lock"), preserve_lock_file=True)
        while not stop.is_set():
            with lock:
                samples.append(_stripe_bytes_on_disk(root))
            time.sleep(0.001)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    stop.set()
    sampler.join(timeout=10)
    assert not failures, failures
    assert max(samples) <= cap and _stripe_bytes_on_disk(root) <= cap
    assert backends[0].used_bytes() == backends[1].used_bytes() == _stripe_bytes_on_disk(root)
    live = [f"w{i}x{j}" for i in range(2) for j in range(40) if (root / "stripes" / f"w{i}x{j}").exists()]
    keys = [f"{sid}:chunk{c}".encode() for sid in live for c in range(8)]
    assert all(t is not None for t in backends[1].get_tickets(keys))  # every live stripe keeps its tickets
    for b in backends:
        b.close()


@pytest.mark.timeout(60)
def test_eviction_is_lru_and_drops_only_the_tickets_of_the_evicted_stripe(tmp_path: Path) -> None:
    one = 2 * 10_000
    b = FileBackend(tmp_path / "s", 4 * one + 100)
    for sid in "abc":
        assert b.write_stripe(_stripe(sid, 2, 10_000, num_chunks=2))
    shared = StripeWrite("d", _stripe("d", 2, 10_000).layer_values,
                         [(b"b:chunk0", b"ticket d 0"), (b"d:chunk1", b"ticket d 1")])  # re-points b's chunk0
    assert b.write_stripe(shared)
    assert _read(b, "a", 0, 0, 5)[0]  # a is now the most recently used: b goes first
    assert b.write_stripe(_stripe("e", 2, 10_000, num_chunks=2))
    assert not _read(b, "b", 0, 0, 5)[0]
    assert all(_read(b, sid, 1, 0, 5)[0] for sid in "acde")
    assert b.get_tickets([b"b:chunk0", b"b:chunk1", b"a:chunk0"]) == [b"ticket d 0", None, b"ticket a 0"]
    assert b.take_evicted() == [b"b:chunk1"]
    assert b.used_bytes() == _stripe_bytes_on_disk(tmp_path / "s") == 4 * one


@pytest.mark.timeout(60)
def test_leases_block_eviction_and_expired_leases_do_not(tmp_path: Path) -> None:
    one = 20_000
    b = FileBackend(tmp_path / "s", 2 * one)
    assert b.write_stripe(_stripe("a", 1, one, num_chunks=1))
    assert b.write_stripe(_stripe("b", 1, one, num_chunks=1))
    b.lease(["a", "b"], 30)
    b.lease(["a"], 30)
    assert b.num_leases() == 3
    assert not b.write_stripe(_stripe("c", 1, one, num_chunks=1))  # everything leased: skipped
    assert not (tmp_path / "s" / "stripes" / "c").exists() and b.get_tickets([b"c:chunk0"]) == [None]
    b.release(["a", "b"])  # a still holds one lease (counted), b none
    assert b.write_stripe(_stripe("c", 1, one, num_chunks=1))
    assert _read(b, "a", 0, 0, 1)[0] and not _read(b, "b", 0, 0, 1)[0]
    b.release(["a"])
    b.release(["a", "zzz"])  # releasing what is not held is harmless
    assert b.num_leases() == 0
    b.lease(["a", "c"], 0.2)
    time.sleep(0.3)
    assert b.num_leases() == 0
    assert b.write_stripe(_stripe("d", 1, one, num_chunks=1))  # expired leases protect nothing
    assert not _read(b, "a", 0, 0, 1)[0] and _read(b, "d", 0, 0, 1)[0]
    assert not os.listdir(tmp_path / "s" / "leases")  # expired lease files were removed
    assert not b.write_stripe(_stripe("huge", 1, 3 * one))  # larger than the budget: skipped, nothing evicted
    assert _read(b, "c", 0, 0, 1)[0] and _read(b, "d", 0, 0, 1)[0]


@pytest.mark.timeout(60)
def test_two_instances_on_one_root_share_tickets_stripes_and_leases(tmp_path: Path) -> None:
    one = 20_000
    a = FileBackend(tmp_path / "s", 2 * one)
    b = FileBackend(tmp_path / "s", 2 * one)
    w = _stripe("x", 1, one, num_chunks=1)
    assert a.write_stripe(w)
    assert b.get_tickets([b"x:chunk0"]) == [b"ticket x 0"]
    assert _read(b, "x", 0, 100, 50) == (True, w.layer_values[0][100:150])
    b.lease(["x"], 30)
    assert a.num_leases() == 1
    assert a.write_stripe(_stripe("y", 1, one, num_chunks=1))
    b.lease(["y"], 30)
    assert not a.write_stripe(_stripe("z", 1, one, num_chunks=1))  # a sees b's leases: nothing to evict
    b.release(["x", "y"])
    assert a.write_stripe(_stripe("z", 1, one, num_chunks=1))  # x, the least recently used, goes
    assert not _read(b, "x", 0, 0, 1)[0] and b.get_tickets([b"x:chunk0"]) == [None]
    b.delete_tickets([b"z:chunk0"])
    assert a.get_tickets([b"z:chunk0", b"y:chunk0"]) == [None, b"ticket y 0"]
    assert a.used_bytes() == b.used_bytes() == _stripe_bytes_on_disk(tmp_path / "s") == 2 * one


_CHILD = textwrap.dedent("""
    import random, sys
    from range_connector.backends.base import RangeRead, StripeWrite
    from range_connector.backends.file.backend import FileBackend
    b = FileBackend(sys.argv[1])
    values = [random.Random(layer).randbytes(50_001) for layer in range(3)]
    assert b.write_stripe(StripeWrite("child", values, [(b"child:0", b"ticket from the child")]))
    dest = bytearray(40_000)
    assert b.read_ranges([RangeRead("parent", 1, 123, 40_000, 60_000, memoryview(dest))]) == [True]
    assert dest == random.Random(101).randbytes(60_000)[123:40_123]
    print("ok")
""")


@pytest.mark.timeout(120)
def test_a_stripe_written_by_another_process_is_read_here(tmp_path: Path) -> None:
    b = FileBackend(tmp_path / "s")
    assert b.write_stripe(StripeWrite("parent", [random.Random(100 + i).randbytes(60_000) for i in range(2)], []))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=100, env=env, cwd=REPO_ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert b.get_tickets([b"child:0"]) == [b"ticket from the child"]
    assert _read(b, "child", 2, 7, 49_994) == (True, random.Random(2).randbytes(50_001)[7:50_001])


@pytest.mark.timeout(60)
def test_corrupt_bytes_are_returned_as_stored_and_a_short_stripe_is_a_miss(backend: FileBackend) -> None:
    """The file tier does not verify payloads: a flipped byte reaches the caller, whose per-chunk checksum (ticket
    ``checksums``, verified before a block reaches attention) turns it into a miss. A stripe shorter than its header
    says, or with a bad header, reads as a miss (``False``), never as garbage."""
    w = _stripe("c", 2, 1000)
    assert backend.write_stripe(w)
    path = backend.root / "stripes" / "c"
    with open(path, "r+b") as f:
        f.seek(PAGE + 1000 + 10)
        f.write(bytes([w.layer_values[1][10] ^ 0xFF]))
    ok, got = _read(backend, "c", 1, 0, 1000)
    assert ok and got[10] == w.layer_values[1][10] ^ 0xFF and got[:10] + got[11:] == (
        w.layer_values[1][:10] + w.layer_values[1][11:])
    os.truncate(path, PAGE + 1500)
    assert not _read(backend, "c", 1, 0, 1000)[0]
    assert _read(backend, "c", 0, 0, 1000) == (True, w.layer_values[0])  # layer 0 is still whole
    path.write_bytes(b"junk" * 2000)
    assert not _read(backend, "c", 0, 0, 10)[0]


@pytest.mark.timeout(60)
def test_odirect_and_buffered_reads_give_the_same_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if reason := odirect_refusal(tmp_path):
        pytest.skip(reason)
    root = tmp_path / "s"
    buffered, direct = FileBackend(root), FileBackend(root, use_odirect=True)
    assert buffered.write_stripe(_stripe("bw", 3, 10_007, seed=5))  # layers back to back
    assert direct.write_stripe(_stripe("dw", 3, 10_007, seed=6))  # layers padded to the page
    for sid in ("bw", "dw"):
        for layer, off, n in [(0, 0, 10_007), (1, 4095, 2), (2, 9_000, 1_007), (2, 1, 10_000)]:
            assert _read(buffered, sid, layer, off, n) == _read(direct, sid, layer, off, n)
            assert _read(direct, sid, layer, off, n)[0]
    assert direct.counters.allocations >= 1  # the aligned bounce buffer
    # a file system that refuses O_DIRECT (EINVAL): one log line, then buffered reads
    fallback = FileBackend(root, use_odirect=True)

    def refuse(*args, **kwargs):
        raise OSError(errno.EINVAL, "Invalid argument")

    fallback._files.pread_direct = refuse  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="range_connector.backends.file.backend"):
        assert _read(fallback, "dw", 1, 3, 500) == _read(buffered, "dw", 1, 3, 500)
    assert "O_DIRECT refused" in caplog.text and not fallback._files.direct_reads


@pytest.mark.timeout(60)
def test_read_commands_follow_bytes_not_chunks(backend: FileBackend) -> None:
    """A layer read as 1 range or as 64 contiguous chunk ranges costs the same system calls (preadv of 64 views)."""
    layer_bytes = 64 * 1024
    assert backend.write_stripe(_stripe("big", 4, layer_bytes))
    counts = []
    for pieces in (1, 64):
        step = layer_bytes // pieces
        dests = [memoryview(bytearray(step)) for _ in range(4 * pieces)]
        reads = [RangeRead("big", layer, p * step, step, layer_bytes, dests[layer * pieces + p])
                 for layer in range(4) for p in range(pieces)]
        before = backend.counters.snapshot()
        assert all(backend.read_ranges(reads))
        after = backend.counters.snapshot()
        counts.append({k: after[k] - before[k] for k in ("round_trips", "commands", "bytes_read")})
    assert counts[0]["round_trips"] == counts[1]["round_trips"] == 1
    assert counts[0]["commands"] == counts[1]["commands"]
    assert counts[0]["bytes_read"] == counts[1]["bytes_read"] == 4 * layer_bytes


@pytest.mark.timeout(60)
def test_deadlines_are_honoured(tmp_path: Path) -> None:
    """A stripe that blocks its reader (a FIFO with no writer), a ticket log held by a stuck call, and a lock held by
    another process: every call ends with BackendTimeoutError at its deadline (the error names it; not before it, and
    nowhere near a hang: only a bound that a hang would pass is timed), and the tier serves afterwards."""
    wide_s = 10.0
    b = FileBackend(tmp_path / "s", 10**9, timeout_s=0.5)
    assert b.write_stripe(_stripe("ok", 1, 100))
    fifo = b.root / "stripes" / "stuck"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(BackendTimeoutError, match="within 0.5 s"):
        _read(b, "stuck", 0, 0, 10)
    assert 0.5 <= time.monotonic() - start < wide_s
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open go
    fifo.unlink()
    with b._log.lock:  # a lookup stuck behind another call reading the log
        start = time.monotonic()
        with pytest.raises(BackendTimeoutError, match="within 0.5 s"):
            b.get_tickets([b"ok:chunk0"])
        assert 0.5 <= time.monotonic() - start < wide_s
    with filelock.FileLock(str(b.root / "lock"), preserve_lock_file=True):
        for call in (lambda: b.write_stripe(_stripe("late", 1, 100)), lambda: b.delete_tickets([b"ok:chunk0"])):
            start = time.monotonic()
            with pytest.raises(BackendTimeoutError, match="within 0.5 s"):
                call()
            assert 0.5 <= time.monotonic() - start < wide_s
    end = time.monotonic() + wide_s  # (the calls that gave up end in the background: wait for their leftovers to go)
    while [p for p in (b.root / "stripes").iterdir() if p.name.startswith("late")]:
        assert time.monotonic() < end, "a late write left files behind"
        time.sleep(0.01)
    assert _read(b, "ok", 0, 0, 100)[0] and b.get_tickets([b"ok:chunk0"]) == [b"ticket ok 0"]
    assert b.write_stripe(_stripe("late", 1, 100))


@pytest.mark.timeout(60)
def test_crashed_writer_leftovers_are_cleaned_by_the_next_eviction(tmp_path: Path) -> None:
    b = FileBackend(tmp_path / "s", 3 * 20_000, timeout_s=1.0)
    assert b.write_stripe(_stripe("a", 1, 20_000, num_chunks=1))
    stale = b.root / "stripes" / "dead.0123.tmp"
    stale.write_bytes(bytes(PAGE + 20_000))  # a reservation whose writer died an hour ago
    os.utime(stale, (time.time() - 3600,) * 2)
    assert b.used_bytes() == 2 * 20_000
    assert b.write_stripe(_stripe("b", 1, 20_000, num_chunks=1))
    assert b.write_stripe(_stripe("c", 1, 20_000, num_chunks=1))  # needs room: the leftover goes, not a stripe
    assert not stale.exists()
    assert all(_read(b, sid, 0, 0, 1)[0] for sid in "abc")


@pytest.mark.timeout(60)
def test_lookup_and_save_cost_follow_bytes_not_chunks(backend: FileBackend) -> None:
    costs = []
    for num_chunks in (4, 512):
        w = _stripe(f"n{num_chunks}", 8, 64 * 1024, num_chunks=num_chunks)
        before = backend.counters.snapshot()
        assert backend.write_stripe(w)
        mid = backend.counters.snapshot()
        assert backend.get_tickets([k for k, _ in w.tickets]) == [t for _, t in w.tickets]
        after = backend.counters.snapshot()
        costs.append(({k: mid[k] - before[k] for k in mid}, {k: after[k] - mid[k] for k in after}))
    assert costs[0] == costs[1]
    assert costs[0][1]["round_trips"] == costs[0][1]["commands"] == 1


@pytest.mark.timeout(60)
def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    b = FileBackend(tmp_path / "s", fsync=True)
    w = _stripe("f", 2, 5000)
    assert b.write_stripe(w)
    assert _read(b, "f", 1, 0, 5000) == (True, w.layer_values[1])


@pytest.mark.timeout(60)
def test_gds_capability_is_reported_and_checked(backend: FileBackend) -> None:
    ok, reason = gds_status()
    assert backend.supports_gds == ok
    if not ok:
        assert reason.startswith(("no CUDA device", "kvikio not installed"))
        with pytest.raises(BackendError, match="GPUDirect reads unavailable"):
            backend.read_ranges_device([DeviceRead("x", 0, 0, 1, 1, None)])


@pytest.mark.timeout(60)
def test_device_read_path_with_a_stand_in_kvikio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CuFile path's planning and bookkeeping, with a host-memory stand-in for kvikio (the real one needs CUDA:
    ``tests/gpu/test_file_gds.py``)."""
    import types

    import range_connector.backends.file.backend as file_mod

    class FakeFuture:
        def __init__(self, n: int) -> None:
            self.n = n

        def get(self) -> int:
            return self.n

    class FakeCuFile:
        def __init__(self, path: Path, flags: str = "r") -> None:
            self.fd = os.open(path, os.O_RDONLY)

        def __enter__(self) -> FakeCuFile:
            return self

        def __exit__(self, *exc: object) -> None:
            os.close(self.fd)

        def pread(self, buf: bytearray, size: int, file_offset: int = 0) -> FakeFuture:
            return FakeFuture(os.preadv(self.fd, [memoryview(buf)[:size]], file_offset))

    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(CuFile=FakeCuFile))
    monkeypatch.setattr(file_mod, "gds_status", lambda: (True, ""))
    b = FileBackend(tmp_path / "s", use_odirect=True)  # padded layers: the device path must honour the stride
    w = _stripe("dev", 3, 5000)
    assert b.write_stripe(w)
    dests = [memoryview(bytearray(n)) for n in (5000, 10, 1)]  # like torch/CuPy arrays: they have ``nbytes``
    reads = [DeviceRead("dev", 2, 0, 5000, 5000, dests[0]), DeviceRead("dev", 1, 4990, 10, 5000, dests[1]),
             DeviceRead("gone", 0, 0, 1, 1, dests[2])]
    assert b.supports_gds and b.read_ranges_device(reads) == [True, True, False]
    assert dests[0] == w.layer_values[2] and dests[1] == w.layer_values[1][4990:]
    with pytest.raises(ValueError):
        b.read_ranges_device([DeviceRead("dev", 0, 4999, 2, 5001, memoryview(bytearray(2)))])
