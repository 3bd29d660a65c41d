"""File tier (:class:`range_connector.backends.file.backend.FileBackend`) on real file systems of the kinds an NVMe
deployment meets: one that fills up (a small tmpfs mounted for the test: ``ENOSPC`` wherever the save meets it),
one that refuses ``O_DIRECT`` (``EINVAL``), and one that accepts it.

A full file system skips the save (``False``, ``counters.saves_skipped_no_space``), leaves nothing half-written and
no stripe without its tickets, and the next save after space came back is stored. The file systems come from the
fixtures of ``tests/conftest.py`` (:mod:`tests.filesystems`); where they cannot be mounted, the tests are skipped
with the reason.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import range_connector.backends.file.ticket_log as ticket_log_mod
from range_connector.backends.base import RangeRead, StripeWrite
from range_connector.backends.file.backend import FileBackend
from range_connector.backends.file.stripes import PAGE
from tests.backends.test_file_backend import REPO_ROOT, _read, _stripe, _stripe_bytes_on_disk
from tests.filesystems import fill_up, free_bytes, odirect_refusal

LOGGER = "range_connector.backends.file.backend"


def _leftovers(root: Path) -> list[str]:
    """Temp files anywhere in the shard: what a write or a rewrite left behind."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def _no_space_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no space left" in r.getMessage()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity_bytes", [None, 8 << 20], ids=["no-budget", "budget-over-the-disk"])
def test_a_full_file_system_skips_the_save_counts_it_leaves_nothing_and_the_next_save_is_stored(
        small_tmpfs: Path, capacity_bytes: int | None, caplog: pytest.LogCaptureFixture) -> None:
    """The disk fills before the budget does (or there is no budget): the stripe's writes fail with ENOSPC."""
    root = small_tmpfs / "shard"
    b = FileBackend(root, capacity_bytes, timeout_s=10.0)
    filler = fill_up(small_tmpfs / "filler", leave_bytes=640 * 1024)  # room for two stripes and a half
    stored = [_stripe(f"kept{i}", 2, 128 * 1024, seed=i) for i in range(2)]
    assert all(b.write_stripe(w) for w in stored)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(2):  # the second skip is counted, not logged again
            w = _stripe(f"full{i}", 2, 128 * 1024, seed=10 + i)
            assert b.write_stripe(w) is False
            assert b.get_tickets([k for k, _ in w.tickets]) == [None, None]
            assert not _read(b, w.stripe_id, 0, 0, 1)[0]
    assert b.counters.saves_skipped_no_space == 2 and b.out_of_space
    assert len(_no_space_records(caplog)) == 1
    assert _leftovers(root) == [] and sorted(os.listdir(root / "stripes")) == ["kept0", "kept1"]
    assert b.used_bytes() == _stripe_bytes_on_disk(root) == sum(w.nbytes for w in stored)
    for w in stored:
        assert _read(b, w.stripe_id, 1, 0, 128 * 1024) == (True, w.layer_values[1])
    filler.unlink()  # space came back: the very next save is stored
    again = _stripe("again", 2, 128 * 1024, seed=20)
    assert b.write_stripe(again) and not b.out_of_space
    assert _read(b, "again", 1, 0, 128 * 1024) == (True, again.layer_values[1])
    assert b.get_tickets([k for k, _ in again.tickets]) == [t for _, t in again.tickets]
    assert b.counters.saves_skipped_no_space == 2
    assert b.used_bytes() == _stripe_bytes_on_disk(root) == sum(w.nbytes for w in stored) + again.nbytes
    b.close()


@pytest.mark.timeout(60)
def test_a_stripe_whose_tickets_cannot_be_appended_is_removed_and_the_save_skipped(small_tmpfs: Path) -> None:
    """The stripe's own pages fit, its ticket frame does not (it needs pages of its own): the stripe, already
    renamed into place, goes again, the log keeps no part of the frame, and the save is a skip."""
    root = small_tmpfs / "shard"
    b = FileBackend(root, timeout_s=10.0)
    stripe_pages = 1 + 2 * 8192 // PAGE  # the header page and two layers of 8 KiB
    many = StripeWrite("many", _stripe("many", 2, 8192).layer_values,
                       [(b"many:%04d" % c, bytes(60)) for c in range(200)])  # a 14 KiB frame
    fill_up(small_tmpfs / "filler", leave_bytes=stripe_pages * PAGE)
    assert free_bytes(small_tmpfs) == stripe_pages * PAGE
    assert b.write_stripe(many) is False
    assert b.counters.saves_skipped_no_space == 1
    assert os.listdir(root / "stripes") == [] and _leftovers(root) == []
    assert all((root / "tickets" / name).stat().st_size == 0 for name in os.listdir(root / "tickets"))
    assert b.get_tickets([k for k, _ in many.tickets[:3]]) == [None] * 3
    assert b.used_bytes() == 0 == _stripe_bytes_on_disk(root)
    assert free_bytes(small_tmpfs) == stripe_pages * PAGE  # every page it took was given back
    small = _stripe("small", 1, 8192, num_chunks=1)  # 3 pages and one page of log: it fits
    assert b.write_stripe(small)
    assert FileBackend(root).get_tickets([b"small:chunk0", b"many:0000"]) == [b"ticket small 0", None]
    b.close()


@pytest.mark.timeout(60)
def test_a_ticket_log_rewrite_on_a_full_file_system_keeps_the_log_and_leaves_no_temp_file(
        small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Appends still fit in the log's last page; the rewrite needs a page of its own and there is none."""
    monkeypatch.setattr(ticket_log_mod, "_COMPACT_MIN", 0)  # rewritten once the log has grown 4x its first frame
    root = small_tmpfs / "shard"
    b = FileBackend(root, timeout_s=10.0)
    w = _stripe("w", 1, 64, num_chunks=12)
    keys = [k for k, _ in w.tickets]
    assert b.write_stripe(w)
    filler = fill_up(small_tmpfs / "filler")
    assert free_bytes(small_tmpfs) == 0
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(12):  # each call appends a frame of deletes, until the log is due for a rewrite
            b.delete_tickets(keys)
            if any("not rewritten" in r.getMessage() for r in caplog.records):
                break
    assert [r.getMessage() for r in caplog.records if "not rewritten" in r.getMessage()]
    assert os.listdir(root / "tickets") == ["000000000000.log"] and _leftovers(root) == []
    assert FileBackend(root).get_tickets(keys) == [None] * 12
    filler.unlink()
    b.delete_tickets(keys[:1])  # the next append rewrites it
    assert os.listdir(root / "tickets") == ["000000000001.log"] and _leftovers(root) == []
    later = _stripe("later", 1, 64, num_chunks=1)
    assert b.write_stripe(later)
    assert FileBackend(root).get_tickets(keys + [b"later:chunk0"]) == [None] * 12 + [b"ticket later 0"]
    b.close()


@pytest.mark.timeout(60)
def test_odirect_falls_back_to_buffered_reads_once_where_the_file_system_refuses_it(
        odirect_refusing_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = FileBackend(odirect_refusing_dir / "shard", use_odirect=True)
    assert b.direct_reads  # configured, not yet tried
    layer_bytes = 3 * PAGE + 123
    w = _stripe("d", 3, layer_bytes, seed=3)
    assert b.write_stripe(w)
    assert (b.root / "stripes" / "d").stat().st_size == PAGE + 3 * 4 * PAGE  # layers padded to the page
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for layer, off, n in [(0, 0, layer_bytes), (2, 4095, 2), (1, 17, layer_bytes - 17), (2, 0, layer_bytes)]:
            assert _read(b, "d", layer, off, n) == (True, w.layer_values[layer][off:off + n])
    assert not b.direct_reads
    assert len([r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]) == 1
    assert b.counters.allocations == 0  # no bounce buffer was ever needed
    b.close()


@pytest.fixture
def odirect_accepting_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on a file system that accepts O_DIRECT: the test's temporary directory, else one under
    /var/tmp or the repository's checkout. Skipped, with the reasons, where none does."""
    reasons = []
    for parent in (tmp_path, Path("/var/tmp"), REPO_ROOT):
        try:
            with tempfile.TemporaryDirectory(prefix=".odirect-", dir=parent) as scratch:
                if (reason := odirect_refusal(Path(scratch))) is None:
                    yield Path(scratch)
                    return
                reasons.append(reason)
        except OSError as exc:
            reasons.append(f"no scratch directory under {parent} ({exc})")
    pytest.skip("no file system here accepts O_DIRECT: " + "; ".join(reasons))


@pytest.mark.timeout(60)
def test_odirect_reads_round_trip_where_the_file_system_accepts_it(odirect_accepting_dir: Path) -> None:
    b = FileBackend(odirect_accepting_dir / "shard", use_odirect=True)
    layer_bytes = 5 * PAGE + 1
    w = _stripe("d", 2, layer_bytes, seed=4)
    assert b.write_stripe(w)
    dests = [memoryview(bytearray(n)) for n in (layer_bytes, 1, PAGE + 2)]
    reads = [RangeRead("d", 1, 0, layer_bytes, layer_bytes, dests[0]),
             RangeRead("d", 0, layer_bytes - 1, 1, layer_bytes, dests[1]),
             RangeRead("d", 0, PAGE - 1, PAGE + 2, layer_bytes, dests[2])]
    assert b.read_ranges(reads) == [True, True, True]
    assert dests[0] == w.layer_values[1] and dests[1] == w.layer_values[0][-1:]
    assert dests[2] == w.layer_values[0][PAGE - 1:2 * PAGE + 1]
    assert b.direct_reads and b.counters.allocations >= 1  # read through the aligned bounce buffer
    b.close()
