"""File tier (:class:`range_connector.backends.file.backend.FileBackend`), its byte count against the files (C17):
``used_bytes()`` equals the sizes ``os.stat`` gives for the stripe files, less their header pages, after every save
and every removal, whatever removed the bytes: eviction under the budget, an overwrite, ``drop_stripes``,
``clear``, the leftover of a writer killed mid-stripe and the eviction that removes it. ``delete_tickets`` removes
no bytes (the stripe ages out). The cap holds throughout and saves keep being stored.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from range_connector.backends.file.backend import FileBackend
from range_connector.backends.file.stripes import PAGE
from tests.backends.test_file_atomicity import kill_a_writer_mid_stripe
from tests.backends.test_file_backend import _stripe, _stripe_bytes_on_disk


@pytest.mark.timeout(120)
def test_c17_save_and_delete_cycles_past_the_cap_keep_accounting_equal_to_the_files(tmp_path: Path) -> None:
    root = tmp_path / "shard"
    cap = 160 * 1024
    b = FileBackend(root, cap, timeout_s=10.0)
    rng = random.Random(1717)
    nbytes: dict[str, int] = {}  # layer bytes of each stripe id's last save, and of each killed writer's reservation
    paths: Counter[str] = Counter()  # how often each way of removing bytes was taken
    written = 0

    def check(what: str) -> None:
        files = {p.name: p.stat().st_size for p in (root / "stripes").iterdir()}
        on_disk = _stripe_bytes_on_disk(root)
        assert b.used_bytes() == on_disk, what
        assert on_disk == sum(size - PAGE for size in files.values()), what
        assert on_disk == sum(nbytes[name] for name in files), what  # each file is its save's bytes, no more
        assert on_disk <= cap, what

    def live() -> list[str]:
        return sorted(n for n in os.listdir(root / "stripes") if n.isalnum())

    for i in range(60):
        overwrite = i % 10 == 4 and bool(live())
        sid = rng.choice(live()) if overwrite else f"c{i}"
        before = set(live())
        w = _stripe(sid, rng.randint(1, 4), rng.randint(1_000, 12_000), num_chunks=rng.randint(0, 6), seed=i)
        assert b.write_stripe(w), f"save {i} skipped"
        nbytes[sid] = w.nbytes
        written += w.nbytes
        paths["overwrite"] += overwrite
        paths["eviction"] += bool(before - set(live()))
        check(f"save {i} of {sid}")
        if i % 10 == 1:  # tickets only: the bytes stay until the stripe ages out
            used = b.used_bytes()
            b.delete_tickets([k for k, _ in w.tickets[:3]])
            assert b.used_bytes() == used
            paths["delete_tickets"] += 1
        elif i % 10 == 3:
            b.drop_stripes([rng.choice(live())])
            paths["drop_stripes"] += 1
        elif i in (6, 36):  # a writer killed mid-stripe, in another process, with the same budget
            tmp = kill_a_writer_mid_stripe(root, f"dead{i}", 2, 9_000, cap)
            nbytes[tmp.name] = 2 * 9_000
            check(f"writer killed at {i}")
            os.utime(tmp, (time.time() - 3600,) * 2)  # long dead: the next eviction removes it
            paths["leftover"] += 1
        elif i == 29:
            b.clear()
            assert b.used_bytes() == 0
            paths["clear"] += 1
        check(f"after cycle {i}")
    assert written > 5 * cap
    assert not [n for n in os.listdir(root / "stripes") if n.endswith(".tmp")]  # the leftovers were evicted
    assert set(paths) == {"overwrite", "eviction", "delete_tickets", "drop_stripes", "leftover", "clear"}
    assert all(paths.values()), paths
    b.close()
