"""File tier (:class:`range_connector.backends.file.backend.FileBackend`), its ticket log: rewritten once it grows
(compaction), with every instance on the same directory following the new generation, and a torn or damaged tail
(a writer killed mid-append, bytes that fail their check) ignored by readers and cut by the next writer.

Stripes are built with the file tier tests' helper (``test_file_backend.py``).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest

from range_connector.backends.file.backend import FileBackend
from tests.backends.test_file_backend import _stripe


@pytest.mark.timeout(60)
def test_ticket_log_is_rewritten_and_every_instance_follows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import range_connector.backends.file.ticket_log as ticket_log_mod

    monkeypatch.setattr(ticket_log_mod, "_COMPACT_MIN", 4096)
    root = tmp_path / "s"
    writer, reader = FileBackend(root), FileBackend(root)
    expected: dict[bytes, bytes | None] = {}
    for i in range(60):
        w = _stripe(f"r{i}", 1, 64, num_chunks=3)
        assert writer.write_stripe(w)
        expected.update(w.tickets)
        if i % 5 == 0:
            writer.delete_tickets([w.tickets[0][0]])
            expected[w.tickets[0][0]] = None
        if i == 3:
            (root / "stripes" / "r1").unlink()  # gone behind the tier's back: its tickets go at the next rewrite
        if i % 7 == 0:
            keys = [k for k in expected if not k.startswith(b"r1:")]
            assert reader.get_tickets(keys) == [expected[k] for k in keys]
    logs = sorted(os.listdir(root / "tickets"))
    assert len(logs) == 1 and logs[0] != "000000000000.log"  # rewritten at least once, old generations removed
    assert (root / "tickets" / logs[0]).stat().st_size < 16 * 4096
    for key in (b"r1:chunk0", b"r1:chunk1", b"r1:chunk2"):
        expected[key] = None
    for b in (reader, writer, FileBackend(root)):
        assert b.get_tickets(list(expected)) == list(expected.values())


@pytest.mark.timeout(60)
def test_torn_or_damaged_ticket_log_tail_is_ignored_then_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "s"
    a, b = FileBackend(root), FileBackend(root)
    assert a.write_stripe(_stripe("t1", 1, 64, num_chunks=2))
    (log,) = (root / "tickets").iterdir()
    good = log.stat().st_size
    with open(log, "ab") as f:  # a writer killed in the middle of its append
        f.write(struct.pack("<II", 1000, 0) + b"partial")
    assert b.get_tickets([b"t1:chunk0", b"t1:chunk1"]) == [b"ticket t1 0", b"ticket t1 1"]
    assert a.write_stripe(_stripe("t2", 1, 64, num_chunks=1))  # the next writer cuts the torn tail first
    assert b.get_tickets([b"t2:chunk0", b"t1:chunk1"]) == [b"ticket t2 0", b"ticket t1 1"]
    size = log.stat().st_size
    with open(log, "ab") as f:  # a complete frame whose bytes are wrong
        f.write(struct.pack("<II", 5, 12345) + b"fives")
    with caplog.at_level(logging.WARNING, logger="range_connector.backends.file.backend"):
        c = FileBackend(root)
        assert c.get_tickets([b"t2:chunk0"]) == [b"ticket t2 0"]
    assert "damaged" in caplog.text
    assert a.write_stripe(_stripe("t3", 1, 64, num_chunks=1))
    assert log.stat().st_size > size and good < size
    for x in (a, b, c):
        assert x.get_tickets([b"t3:chunk0", b"t2:chunk0"]) == [b"ticket t3 0", b"ticket t2 0"]
