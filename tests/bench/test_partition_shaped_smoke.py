"""Smoke run of ``bench/partition_shaped.py``: the mechanism of the shaped-link simulation works.

Runs ``bench/partition_shaped.py --smoke`` (16 MiB, S = 1 and 2, each server in its own network namespace behind a
1000 Mbit/s tbf link, plus one unshaped loopback server, 1 timed round) as a subprocess and checks the JSON it
writes: every restore is byte-exact; every server reports in its own ``INFO`` at least its shard's bytes sent and
the reads it served (``INFO commandstats``); those bytes went through the server's shaper (``tc -s qdisc``); the
namespaces and veths are gone afterwards. Bandwidths and the printed verdict are the benchmark's measurement and are
not asserted. Also checks that a run's leftovers (a namespace named after a dead pid) are cleaned up.

Skips, with the reason, where network namespaces, veths or tbf cannot be set up (not root, no CAP_NET_ADMIN, no
iproute2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "partition_shaped.py"
sys.path.insert(0, str(REPO / "bench"))
import shaped_links  # noqa: E402

NUM_LAYERS = 32
PAYLOAD_BYTES = 16 << 20


@pytest.fixture(scope="module")
def netns_available() -> None:
    reason = shaped_links.probe_netns()
    if reason is not None:
        pytest.skip(f"shaped links unavailable here: {reason}")


def _netns_names() -> set[str]:
    return {line.split()[0] for line in shaped_links.run_cmd("ip", "netns", "list").splitlines() if line.split()}


@pytest.mark.timeout(90)
def test_partition_shaped_smoke(tmp_path: Path, netns_available: None) -> None:
    out = tmp_path / "partition-shaped.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, timeout=80, cwd=str(REPO))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    check_shaped_doc(doc)
    links = doc["config"]["links"]
    assert not {link["ns"] for link in links} & _netns_names(), "namespaces left behind"
    devices = shaped_links.run_cmd("ip", "-o", "link", "show")
    assert not [link["host_dev"] for link in links if f" {link['host_dev']}@" in devices], "veths left behind"


def check_shaped_doc(doc: dict) -> None:
    """What the smoke run's JSON must show (apart from the run, so that it can be checked on a doctored copy)."""
    cfg = doc["config"]
    assert cfg["smoke"] is True and cfg["payload_bytes"] == PAYLOAD_BYTES and cfg["shard_counts"] == [1, 2]
    rows = {(r["path"], r["case"]): r for r in doc["rows"]}
    cases = ["S1-shaped", "S2-shaped", "S1-loopback"]
    assert sorted(rows) == sorted((p, c) for p in ("worker", "fetch") for c in cases)
    assert all(r["status"] == "ok" and r["byte_exact"] and r["mib_per_s"] > 0 for r in rows.values()), rows
    links = cfg["links"]
    assert len(links) == 2 and len({link["server_addr"] for link in links}) == 2
    assert all(link["server_addr"].startswith("10.231.") and "tbf rate 1000mbit" in link["tbf"] for link in links)
    for (path, case), row in rows.items():
        s = row["num_shards"]
        shard_bytes = PAYLOAD_BYTES // s
        assert len(row["server_bytes_median"]) == s
        assert all(b >= shard_bytes for b in row["server_bytes_median"]), (path, case, row["server_bytes_median"])
        assert len(row["server_commands_last"]) == s
        for calls in row["server_commands_last"]:  # every layer value of the shard's stripe read on its server
            assert calls.get("get", 0) + calls.get("getrange", 0) >= NUM_LAYERS, (path, case, calls)
        if row["placement"] == "shaped":  # the replies went through the server's shaper
            assert len(row["shaper_bytes_last"]) == s
            assert all(q["reads"] >= shard_bytes for q in row["shaper_bytes_last"]), row["shaper_bytes_last"]
        else:
            assert row["shaper_bytes_last"] == []
    for path in ("worker", "fetch"):  # the verdict is computed and printed; its value is the measurement
        res = doc["analysis"]["per_path"][path]
        assert res["verdict"] in ("PASS", "FAIL") and set(res["per_s"]) == {"S1", "S2"}
        assert res["premise"]["unshaped_mib_per_s"] == rows[(path, "S1-loopback")]["mib_per_s"]
    assert doc["plot"] and Path(doc["plot"]).is_file()


@pytest.mark.timeout(30)
def test_clean_stale_removes_a_dead_runs_namespace(netns_available: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    name = f"{shaped_links.NS_PREFIX}{dead.pid}-0"
    shaped_links.run_cmd("ip", "netns", "add", name)
    try:
        assert name in shaped_links.clean_stale()
        assert name not in _netns_names()
    finally:
        if name in _netns_names():
            shaped_links.run_cmd("ip", "netns", "del", name)
