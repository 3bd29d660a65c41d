"""Smoke run of ``bench/partition.py``: every case restores byte-exact, bytes per server fall as 1/S (from the
servers' own INFO), and the fetch path reads each shard's server from a thread of its own (from its request
timeline), so that requests to different servers can be in flight at once.

How much they overlap in time (``multi_server_s``) is the benchmark's measurement and is not asserted: on a busy
2-core machine one shard's read can end before the next thread has started.

Runs ``bench/partition.py --smoke`` (16 MiB, S = 1, 2, 4 and one shared server, 2 timed rounds) as a subprocess with
Valkey servers of its own, and checks the JSON it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "partition.py"


@pytest.mark.timeout(150)
def test_partition_smoke(tmp_path: Path) -> None:
    out = tmp_path / "partition.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=140, cwd=str(REPO))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    check_partition_doc(json.loads(out.read_text()))


def check_partition_doc(doc: dict) -> None:
    """What the smoke run's JSON must show (apart from the run, so that it can be checked on a doctored copy)."""
    assert doc["config"]["smoke"] is True and doc["config"]["payload_bytes"] == 16 << 20
    rows = {(r["path"], r["case"]): r for r in doc["rows"]}
    cases = ["S1-partitioned", "S2-partitioned", "S2-shared", "S4-partitioned", "S4-shared"]
    assert sorted(rows) == sorted((p, c) for p in ("worker", "fetch") for c in cases)
    assert all(r["status"] == "ok" and r["byte_exact"] and r["gib_per_s"] > 0 for r in rows.values())
    for path in ("worker", "fetch"):
        total = rows[(path, "S1-partitioned")]["server_bytes_median"][0]
        assert total >= 16 << 20
        for s in (2, 4):
            per_server = rows[(path, f"S{s}-partitioned")]["server_bytes_median"]
            assert len(per_server) == s
            assert all(abs(b / total - 1 / s) < 0.02 for b in per_server), per_server
            assert rows[(path, f"S{s}-shared")]["server_bytes_median"][0] == pytest.approx(total, rel=0.02)
            assert all(c >= 0 for c in rows[(path, f"S{s}-partitioned")]["server_cpu_s_median"])
    for s in (2, 4):  # one fetch thread per shard, each reading only its own server
        row = rows[("fetch", f"S{s}-partitioned")]
        threads: dict[int, set[str]] = {}
        for request in row["timeline_last"]:
            threads.setdefault(request["server"], set()).add(request["thread"])
        assert sorted(threads) == list(range(s)) and all(len(names) == 1 for names in threads.values()), threads
        assert len(set().union(*threads.values())) == s, threads
        overlap = row["overlap_last"]
        assert 0 <= overlap["multi_server_s"] <= overlap["busy_s"] + 1e-9
    assert set(doc["analysis"]["per_path"]["fetch"]) == {"S2", "S4"}
    assert doc["plot"] and Path(doc["plot"]).is_file()
