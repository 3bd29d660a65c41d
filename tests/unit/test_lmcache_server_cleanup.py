"""The shared-memory KV segments that killed LMCache engines leave behind are removed
(``remove_orphan_kv_segments``, run when an :class:`LMCacheServer` starts and stops); a live process's are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from range_connector.testing.lmcache_server import remove_orphan_kv_segments


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_segments_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    names = [f"lmcache_kv_{dead}_0", f"lmcache_kv_{dead}_1", f"lmcache_kv_{live}_0", "lmcache_kv_x_0", "sem.mp-x",
             "psm_1234"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_orphan_kv_segments(shm_dir=tmp_path)
    assert sorted(p.name for p in removed) == [f"lmcache_kv_{dead}_0", f"lmcache_kv_{dead}_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
