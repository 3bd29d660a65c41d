"""File tier (:class:`range_connector.backends.file.backend.FileBackend`): a stripe appears whole or not at all.

A writer fills a temp file, renames it into place, then appends the stripe's tickets; so a reader on the same
directory (another instance: another process's view) never finds a ticket before its stripe is whole, never a stripe
file under its id half-written, and a writer killed in the middle leaves only its temp file, counted against the
budget until the next eviction removes it. The writer is held in the middle of its stripe (a pause in its write
loop), run against free-running readers, and killed (``os._exit`` in another process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from range_connector.backends.base import RangeRead, StripeWrite
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.file.stripes import PAGE
from tests.backends.test_file_backend import REPO_ROOT, _read, _stripe, _stripe_bytes_on_disk

_KILLED_WRITER = textwrap.dedent("""
    import os, sys
    from range_connector.backends.base import StripeWrite
    from range_connector.backends.file.backend import FileBackend
    root, sid, num_layers, layer_bytes, capacity = sys.argv[1:]
    b = FileBackend(root, None if capacity == "none" else int(capacity))
    real = b._files.write

    def write_half_then_die(fd, items, call):
        real(fd, items[:len(items) // 2], call)
        os._exit(9)  # killed in the middle of its stripe: nothing of the writer's own cleanup runs

    b._files.write = write_half_then_die
    values = [bytes([layer + 1]) * int(layer_bytes) for layer in range(int(num_layers))]
    b.write_stripe(StripeWrite(sid, values, [(sid.encode() + b":chunk0", b"ticket of a dead writer")]))
""")


def kill_a_writer_mid_stripe(root: Path, sid: str, num_layers: int, layer_bytes: int,
                             capacity_bytes: int | None) -> Path:
    """Run a writer in another process that dies halfway through writing stripe ``sid`` (``num_layers`` layers of
    ``layer_bytes``) into the shard at ``root``; returns the temp file it left."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(root), sid, str(num_layers), str(layer_bytes),
                          "none" if capacity_bytes is None else str(capacity_bytes)],
                         capture_output=True, text=True, timeout=60, env=env, cwd=REPO_ROOT)
    assert out.returncode == 9, out.stderr
    [tmp] = [p for p in (root / "stripes").iterdir() if p.name.startswith(f"{sid}.") and p.name.endswith(".tmp")]
    return tmp


def _whole(backend: FileBackend, w: StripeWrite) -> list[bytes] | None:
    """Every layer of ``w``'s stripe read back whole, or ``None`` if any layer missed."""
    n = memoryview(w.layer_values[0]).nbytes
    dests = [bytearray(n) for _ in w.layer_values]
    ok = backend.read_ranges([RangeRead(w.stripe_id, layer, 0, n, n, memoryview(d)) for layer, d in enumerate(dests)])
    return [bytes(d) for d in dests] if all(ok) else None


@pytest.mark.timeout(60)
def test_a_reader_finds_neither_ticket_nor_stripe_while_the_writer_is_in_the_middle_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shard"
    writer, reader = FileBackend(root, timeout_s=10.0), FileBackend(root, timeout_s=10.0)
    w = _stripe("s1", 4, 50_000, num_chunks=3, seed=1)
    keys, tickets = [k for k, _ in w.tickets], [t for _, t in w.tickets]
    halfway, resume = threading.Event(), threading.Event()
    seen_at_publish: list[object] = []
    real_write, real_publish = writer._files.write, writer._log.publish

    def write_in_two_halves(fd, items, call):
        real_write(fd, items[:len(items) // 2], call)
        halfway.set()
        assert resume.wait(30)
        real_write(fd, items[len(items) // 2:], call)

    def publish_after_looking(ops):  # the tickets go out now: the stripe must already be whole, under its id
        seen_at_publish.append((reader.get_tickets(keys), _whole(reader, w)))
        real_publish(ops)

    monkeypatch.setattr(writer._files, "write", write_in_two_halves)
    monkeypatch.setattr(writer._log, "publish", publish_after_looking)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(writer.write_stripe(w)))
    thread.start()
    try:
        assert halfway.wait(30)
        [name] = os.listdir(root / "stripes")  # half of it is on disk, in the writer's temp file only
        assert name.startswith("s1.") and name.endswith(".tmp")
        partial = (root / "stripes" / name).read_bytes()
        assert partial[PAGE:PAGE + 50_000] == bytes(w.layer_values[0]) and partial[-50_000:] == bytes(50_000)
        assert reader.get_tickets(keys) == [None] * 3
        assert _whole(reader, w) is None and not _read(reader, "s1", 0, 0, 10)[0]
    finally:
        resume.set()
        thread.join(timeout=30)
    assert result == [True]
    assert seen_at_publish == [([None] * 3, [bytes(v) for v in w.layer_values])]
    assert reader.get_tickets(keys) == tickets and _whole(reader, w) == [bytes(v) for v in w.layer_values]
    assert os.listdir(root / "stripes") == ["s1"]
    writer.close()
    reader.close()


@pytest.mark.timeout(60)
def test_readers_racing_a_writer_see_each_stripe_whole_from_the_first_look(tmp_path: Path) -> None:
    """Readers poll all the time and check each stripe the first time they see its ticket, and the first time they
    see a file under its id (read straight from the directory): the moments a torn stripe would show."""
    root = tmp_path / "shard"
    writer = FileBackend(root, timeout_s=10.0)
    writes = {f"r{i}": _stripe(f"r{i}", 2, (1 << 20) + 4096 * i, num_chunks=2, seed=i) for i in range(12)}
    keys = [w.tickets[0][0] for w in writes.values()]
    done = threading.Event()
    started = threading.Barrier(3)
    errors: list[str] = []
    looks: list[tuple[int, int]] = []  # per reader: (lookups that missed, stripes checked)

    def read() -> None:
        reader = FileBackend(root, timeout_s=10.0)
        by_ticket: set[str] = set()
        by_file: set[str] = set()
        misses = 0
        try:
            started.wait(timeout=30)
            last = False
            while not last:  # (one more look once the writer is done)
                last = done.is_set()
                for w, ticket in zip(writes.values(), reader.get_tickets(keys)):
                    if ticket is None:
                        misses += 1
                    elif w.stripe_id not in by_ticket:
                        by_ticket.add(w.stripe_id)
                        if _whole(reader, w) != [bytes(v) for v in w.layer_values]:
                            errors.append(f"{w.stripe_id}: its ticket was out and the stripe not whole")
                for name in set(os.listdir(root / "stripes")) & writes.keys() - by_file:
                    by_file.add(name)
                    data = (root / "stripes" / name).read_bytes()[PAGE:]
                    if data != b"".join(writes[name].layer_values):
                        errors.append(f"{name}: {len(data)} bytes under its id that are not the stripe's")
            looks.append((misses, len(by_ticket & by_file)))
        except Exception as exc:  # reported below
            errors.append(repr(exc))
        finally:
            reader.close()

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        started.wait(timeout=30)
        for w in writes.values():
            assert writer.write_stripe(w)
    finally:
        done.set()
        for t in readers:
            t.join(timeout=30)
    assert errors == []
    assert [(misses > 0, checked) for misses, checked in looks] == [(True, len(writes))] * 2
    writer.close()


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_stripe_leaves_no_ticket_and_a_counted_temp_file_that_eviction_removes(
        tmp_path: Path) -> None:
    root = tmp_path / "shard"
    one = 2 * 30_000
    b = FileBackend(root, 3 * one, timeout_s=1.0)
    assert b.write_stripe(_stripe("a", 2, 30_000, num_chunks=1))
    tmp = kill_a_writer_mid_stripe(root, "dead", 2, 30_000, 3 * one)
    assert tmp.stat().st_size == PAGE + one  # reserved at full size, half of it written
    assert sorted(os.listdir(root / "stripes")) == sorted(["a", tmp.name])
    assert b.get_tickets([b"dead:chunk0"]) == [None]
    assert not _read(b, "dead", 0, 0, 1)[0]
    assert b.used_bytes() == _stripe_bytes_on_disk(root) == 2 * one  # the reservation still counts
    assert b.write_stripe(_stripe("b", 2, 30_000, num_chunks=1))
    b.lease(["a", "b"], 60.0)
    assert not b.write_stripe(_stripe("c", 2, 30_000, num_chunks=1))  # full: two stripes and the reservation
    os.utime(tmp, (time.time() - 3600,) * 2)  # its writer is long gone
    assert b.write_stripe(_stripe("c", 2, 30_000, num_chunks=1))  # the leftover goes, no stripe
    assert not tmp.exists() and sorted(os.listdir(root / "stripes")) == ["a", "b", "c"]
    assert b.used_bytes() == _stripe_bytes_on_disk(root) == 3 * one
    b.close()
